"""The value explorer: any 2-D slice of an N-D tensor as a table that pages lazily (only the bytes
on screen are read), with a spin box per other dimension, a heatmap and a histogram of the whole
slice, copying a selection as CSV and exporting the tensor to ``.npy`` / ``.pt``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import Checkpoint
from dcpstudio.core.checkpoints.model import dtype_name, printable
from dcpstudio.core.ops.explore.slices import SliceSpec, SliceSummary, cell_note, summarise_slice
from dcpstudio.core.ops.report import exact_count, human_bytes

from ..context import Context
from ..locations import is_remote
from ..notify import describe
from ..value_model import TileLoader, ValueTableModel, csv_text, selection_csv, tile_texts
from ..workers import Job
from .drawing import DrawButton, Heatmap, Histogram
from .pane_error import PaneError
from .work_area import SideScroll

__all__ = ["COPY_LIMIT", "ValueExplorer", "csv_text"]

COPY_LIMIT = 1_000_000  # values copied at once; more belongs in an export
_AUTO_SUMMARY = 16 << 20  # slices up to this size are summarised as soon as they are shown


class ValueExplorer(QWidget):
    def __init__(self, ctx: Context, name: str = "explore", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.name = name
        self.ckpt: Checkpoint | None = None
        self.fqn: str | None = None
        self.spec: SliceSpec | None = None
        self.model: ValueTableModel | None = None
        self.loader: TileLoader | None = None
        self.summary: SliceSummary | None = None
        self.title = QLabel("Select a tensor, then Explore values (Ctrl+E).")
        self.title.setTextFormat(Qt.TextFormat.PlainText)
        self.title.setWordWrap(True)
        self.rows_box = QComboBox()
        self.rows_box.setToolTip("The dimension that runs down the rows")
        self.cols_box = QComboBox()
        self.cols_box.setToolTip("The dimension that runs across the columns")
        self.rows_box.activated.connect(lambda _: self._dims_changed(rows_changed=True))
        self.cols_box.activated.connect(lambda _: self._dims_changed(rows_changed=False))
        self.index_boxes: dict[int, QSpinBox] = {}
        self.index_row = QHBoxLayout()
        self.slice_label = QLabel()
        self.slice_label.setMinimumWidth(self.fontMetrics().horizontalAdvance("showing [:, :, 0]"))  # for every ndim
        self.goto_row, self.goto_col = QSpinBox(), QSpinBox()
        for box, what in ((self.goto_row, "row"), (self.goto_col, "column")):
            box.setToolTip(f"Go to this {what}")
            box.setKeyboardTracking(False)
            box.valueChanged.connect(lambda _: self.go_to(self.goto_row.value(), self.goto_col.value()))
        dims = QHBoxLayout()
        for w in (QLabel("Rows"), self.rows_box, QLabel("Columns"), self.cols_box):
            dims.addWidget(w)
        dims.addWidget(SideScroll(self.index_row), 1)  # many dimensions: it scrolls, the window keeps its width
        for where in (self.slice_label, QLabel("Go to"), self.goto_row, self.goto_col):
            dims.addWidget(where)
        self.table = QTableView()
        self.table.setTabKeyNavigation(False)
        widest = self.table.fontMetrics().horizontalAdvance("-0.000123457")  # 6 significant digits, never elided
        self.table.horizontalHeader().setDefaultSectionSize(widest + 14)
        self.table.verticalHeader().setDefaultSectionSize(22)
        copy = QAction("Copy as CSV", self.table)
        copy.setShortcut(QKeySequence(QKeySequence.StandardKey.Copy))
        copy.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        copy.triggered.connect(self.copy_selection)
        self.table.addAction(copy)
        self.table.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        self.copy_button = QPushButton("Copy as CSV")
        self.copy_button.setToolTip("Copy the selected values as CSV (Ctrl+C in the table)")
        self.copy_button.clicked.connect(self.copy_selection)
        self.export_button = QPushButton("Export tensor…")
        self.export_button.setToolTip("Write this tensor to a .npy or .pt file")
        self.export_button.clicked.connect(self.export)
        self.summary_button = DrawButton()  # shown only where it can draw: never disabled
        self.summary_button.clicked.connect(self.summarise)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.progress.setMaximumWidth(120)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        actions = QHBoxLayout()
        for act in (self.copy_button, self.export_button, self.summary_button, None, self.progress, self.cancel_button):
            actions.addStretch(1) if act is None else actions.addWidget(act)
        self.heatmap = Heatmap()
        self.heatmap.clicked.connect(self.go_to)
        self.histogram = Histogram()
        self.summary_label = QLabel()
        self.summary_label.setWordWrap(True)
        pictures = QHBoxLayout()
        pictures.addWidget(self.heatmap, 1)
        pictures.addWidget(self.histogram, 1)
        side = QWidget()
        side_lay = QVBoxLayout(side)
        side_lay.setContentsMargins(0, 0, 0, 0)
        side_lay.addLayout(pictures, 1)
        side_lay.addWidget(self.summary_label)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(side)
        split.setStretchFactor(0, 2)  # the table first: the pictures summarise it
        split.setStretchFactor(1, 1)
        split.setSizes([340, 170])
        lay = QVBoxLayout(self)
        lay.addWidget(self.title)
        lay.addLayout(dims)
        self.read_error = PaneError()
        lay.addWidget(self.read_error)
        lay.addWidget(split, 1)
        lay.addLayout(actions)
        self._set_busy(False)
        self._enable(False)

    # -- what is shown --------------------------------------------------------------------------------
    def _enable(self, on: bool) -> None:
        for w in (self.rows_box, self.cols_box, self.goto_row, self.goto_col, self.copy_button, self.export_button):
            w.setEnabled(on)
        self.read_error.clear()

    def _set_busy(self, busy: bool) -> None:
        self.progress.setEnabled(busy)
        self.progress.setValue(0)
        self.cancel_button.setEnabled(busy)
        self._offer_summary()

    def slice_bytes(self) -> int:
        """What summarising the slice shown reads: all of it."""
        dtype = self.ckpt.tensor_entry(self.fqn).dtype if self.ckpt is not None and self.fqn is not None else None
        return self.spec.n_rows * self.spec.n_cols * dtype.itemsize if self.spec is not None and dtype else 0

    def _offer_summary(self) -> None:
        """Draw shows while the pictures are missing (too large a slice, a summary cancelled or failed)."""
        job = self.ctx.board.jobs.get(self._kind("summary"))
        missing = self.spec is not None and self.summary is None and not (job is not None and job.running)
        self.summary_button.offer(self.slice_bytes(), _AUTO_SUMMARY, missing)

    def _kind(self, what: str) -> str:
        return f"{self.name}-{what}"

    def clear(self) -> None:
        """Forget the tensor (its checkpoint is being closed)."""
        for what in ("tiles", "summary", "copy", "export"):
            self.ctx.board.cancel(self._kind(what))
        if self.loader is not None:
            self.loader.close()
        self.ckpt = self.fqn = self.spec = self.loader = None
        self.table.setModel(None)
        old, self.model = self.model, None
        if old is not None:
            old.deleteLater()
        self.title.setText("Select a tensor, then Explore values (Ctrl+E).")
        self.slice_label.setText("")
        self._show_goto(0, 0)  # another tensor's coordinates mean nothing here
        self._set_summary(None)
        self._enable(False)

    def show_tensor(self, ckpt: Checkpoint, fqn: str) -> None:
        entry = ckpt.tensor_entry(fqn)
        self.clear()
        self.ckpt, self.fqn = ckpt, fqn
        shape = tuple(entry.shape or ())
        self.title.setText(f"{printable(fqn)} — {dtype_name(entry.dtype)} {list(shape)}, {human_bytes(entry.nbytes)}")
        names = [f"dim {d} ({n})" for d, n in enumerate(shape)]
        self.rows_box.clear()
        self.rows_box.addItems(names or ["scalar"])
        self.cols_box.clear()
        self.cols_box.addItems([*names, "one column"])
        self._enable(True)
        self.set_spec(SliceSpec.default(shape))

    def set_spec(self, spec: SliceSpec) -> None:
        """Show ``spec`` of the current tensor: a fresh table model (its tiles load as they show)."""
        if self.ckpt is None or self.fqn is None:
            return
        for what in ("tiles", "summary"):
            self.ctx.board.cancel(self._kind(what))
        if self.loader is not None:
            self.loader.close()
        ckpt, fqn = self.ckpt, self.fqn
        self.spec = spec
        self.loader = TileLoader(
            lambda tr, tc: tile_texts(ckpt, fqn, spec, tr, tc),
            lambda fn, on_item, on_done: self.ctx.start(self._kind("tiles"), fn, lambda _: None, on_done, on_item),
        )
        old = self.model
        self.model = ValueTableModel(spec, self.loader, self, cell_note(ckpt.tensor_entry(fqn).dtype))
        self.model.failed = self._failed
        self.table.setModel(self.model)
        if old is not None:
            old.deleteLater()
        self.rows_box.setCurrentIndex(spec.rows if spec.rows is not None else 0)
        self.cols_box.setCurrentIndex(spec.cols if spec.cols is not None else self.cols_box.count() - 1)
        self._rebuild_index_boxes(spec)
        self.slice_label.setText(f"showing {spec.label()}")
        self.goto_row.setRange(0, max(0, spec.n_rows - 1))
        self.goto_col.setRange(0, max(0, spec.n_cols - 1))
        self._set_summary(None)
        self.read_error.clear()
        if self.slice_bytes() <= _AUTO_SUMMARY:
            self.summarise()
        else:
            self.summary_label.setText(f"Not drawn by itself: {self.summary_button.toolTip()}")

    def _rebuild_index_boxes(self, spec: SliceSpec) -> None:
        while self.index_row.count():
            item = self.index_row.takeAt(0)
            widget = item.widget() if item is not None else None
            if widget is not None:
                widget.deleteLater()
        self.index_boxes = {}
        for d in spec.free:
            label = QLabel(f"dim {d}")
            box = QSpinBox()
            box.setRange(0, max(0, spec.shape[d] - 1))
            box.setValue(spec.index[d])
            box.setKeyboardTracking(False)
            box.setToolTip(f"Index in dimension {d} (size {spec.shape[d]})")
            box.valueChanged.connect(lambda _=0: self._index_changed())
            self.index_row.addWidget(label)
            self.index_row.addWidget(box)
            self.index_boxes[d] = box

    def _dims_changed(self, *, rows_changed: bool) -> None:
        if self.spec is None or not self.spec.shape:
            return
        rows = self.rows_box.currentIndex()
        cols_pick = self.cols_box.currentIndex()
        cols: int | None = None if cols_pick >= len(self.spec.shape) else cols_pick
        if rows == cols:  # picking the other box's dimension swaps the two
            if rows_changed:
                cols = self.spec.rows
            else:
                rows = self.spec.cols if self.spec.cols is not None else self.spec.rows or 0
        if rows == cols:
            cols = None
        self.set_spec(SliceSpec(self.spec.shape, rows, cols, self.spec.index))

    def _index_changed(self) -> None:
        if self.spec is None:
            return
        index = list(self.spec.index)
        for d, box in self.index_boxes.items():
            index[d] = box.value()
        self.set_spec(SliceSpec(self.spec.shape, self.spec.rows, self.spec.cols, tuple(index)))

    def go_to(self, row: int, col: int) -> None:
        if self.model is None:
            return
        index = self.model.index(min(row, self.model.rowCount() - 1), min(col, self.model.columnCount() - 1))
        self.table.scrollTo(index, QTableView.ScrollHint.PositionAtCenter)
        self.table.setCurrentIndex(index)
        self._show_goto(index.row(), index.column())

    def _show_goto(self, row: int, col: int) -> None:
        for box, value in ((self.goto_row, row), (self.goto_col, col)):
            box.blockSignals(True)  # show where we are without jumping again
            box.setValue(value)
            box.blockSignals(False)

    # -- whole-slice summary --------------------------------------------------------------------------
    def _set_summary(self, summary: SliceSummary | None) -> None:
        self.summary = summary
        self.heatmap.set_summary(summary)
        self._offer_summary()
        if summary is None:
            self.histogram.set_data([], [])
            self.summary_label.setText("")
            return
        self.histogram.set_data(summary.hist_edges, summary.hist_counts)
        bad = summary.count - summary.finite
        self.summary_label.setText(
            f"{exact_count(summary.count)} values in {summary.spec.label()}: "
            f"min {summary.min:.6g}, max {summary.max:.6g}" + (f", {exact_count(bad)} not finite" if bad else "")
        )

    def summarise(self) -> Job | None:
        if self.ckpt is None or self.fqn is None or self.spec is None:
            return None
        ckpt, fqn, spec = self.ckpt, self.fqn, self.spec
        self._set_busy(True)
        self.summary_label.setText("summarising the slice…")

        def work(progress: Any, cancel: Any) -> SliceSummary:
            return summarise_slice(ckpt, fqn, spec, progress=progress, cancel=cancel)

        def done(summary: SliceSummary) -> None:
            if summary.spec == self.spec and fqn == self.fqn:
                self._set_summary(summary)

        job = self.ctx.start(self._kind("summary"), work, done, lambda: self._set_busy(False), self._progress)
        self._offer_summary()
        job.cancelled.connect(lambda: self.summary_label.setText("Summary cancelled."))
        job.errored.connect(lambda e: self._failed(e, spec))
        return job

    def _reread(self, summary: bool) -> None:
        """Read the slice again, tiles and all (a file put back serves both), and its summary."""
        if self.spec is not None:
            self.set_spec(self.spec)  # which summarises a small slice itself
            if summary and not self.cancel_button.isEnabled():
                self.summarise()

    def _failed(self, exc: BaseException, spec: SliceSpec | None = None) -> None:
        """A tile's read failed, or (``spec``) the summary's: said above the table, with Retry."""
        if spec is None:
            self.ctx.notifier.error(exc)  # a tile's failure reaches no job board: logged here
        elif spec == self.spec:
            self.summary_label.setText("")
        else:
            return  # about a slice no longer shown
        what = "Values not read" if spec is None else "Not summarised"
        self.read_error.show_error(f"{what}: {describe(exc)}", lambda: self._reread(spec is not None))

    def _progress(self, p: Any) -> None:
        self.progress.setValue(int(p.fraction * 1000))

    def cancel(self) -> None:
        for what in ("summary", "copy", "export"):
            self.ctx.board.cancel(self._kind(what))

    # -- copy and export ------------------------------------------------------------------------------
    def copy_selection(self) -> Job | None:
        if self.ckpt is None or self.fqn is None or self.spec is None:
            return None
        model = self.table.selectionModel()
        ranges = list(model.selection()) if model is not None else []  # type: ignore[call-overload]
        boxes = [(r.top(), r.bottom() + 1, r.left(), r.right() + 1) for r in ranges]
        if not boxes:
            self.ctx.notifier.info("Select the values to copy first (click, Shift+click, or Ctrl+A).")
            return None
        cells = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in boxes)
        if cells > COPY_LIMIT:
            self.ctx.notifier.info(
                f"{cells:,} values selected; copy at most {COPY_LIMIT:,} at once, or export the tensor instead."
            )
            return None
        ckpt, fqn, spec = self.ckpt, self.fqn, self.spec

        def work(progress: Any, cancel: Any) -> tuple[str, int]:
            return selection_csv(ckpt, fqn, spec, boxes, cancel), cells

        def done(result: tuple[str, int]) -> None:
            text, n = result
            QGuiApplication.clipboard().setText(text)
            self.ctx.notifier.info(f"Copied {n:,} values as CSV.")

        return self.ctx.start(self._kind("copy"), work, done)

    def export(self) -> Job | None:
        if self.ckpt is None or self.fqn is None:
            return None
        ckpt, fqn = self.ckpt, self.fqn
        safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in fqn)[:120] or "tensor"
        folder = Path(self.ctx.settings.last_dir()) if is_remote(ckpt.path) else ckpt.path.parent  # written locally
        dst = self.ctx.save_path(f"Export {fqn}", folder / f"{safe}.npy", "NumPy (*.npy);;PyTorch (*.pt)")
        if dst is None:
            return None
        if dst.suffix.lower() not in (".npy", ".pt"):
            dst = dst.with_name(dst.name + ".npy")
        overwrite = dst.exists()
        if overwrite and not self.ctx.confirm(f"{dst} exists. Replace it?"):
            return None
        self._set_busy(True)

        def work(progress: Any, cancel: Any) -> Any:
            from dcpstudio.core import export_tensor

            with warnings.catch_warnings():  # its notes come back in the result and are shown
                warnings.simplefilter("ignore", UserWarning)
                return export_tensor(ckpt, fqn, dst, overwrite=overwrite, progress=progress, cancel=cancel)

        def done(result: Any) -> None:
            notes = " ".join(getattr(result, "notes", ()) or ())
            self.ctx.notifier.info(f"Exported {fqn} to {Path(dst)}." + (f" {notes}" if notes else ""))

        return self.ctx.start(self._kind("export"), work, done, lambda: self._set_busy(False), self._progress)
