"""The compare view: checkpoint B beside the open checkpoint A (any format pair), every entry with
its status, max abs diff, relative L2 change and cosine similarity, filled in as a worker compares
them; sortable, with editable tolerances, cancellable. Selecting an entry shows both values side
by side.

A comparison can be *focused* on one entry or module (``run(b, only=name)``: what a click on the Run
view's plot asks): only that entry, or the entries under that module, are compared -- at the cost of
their own bytes -- and the entry is selected when done. A bar above the table says so, with
Compare Everything to widen to the whole checkpoints; the focus stays for a new B or new tolerances
until it is widened or A changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMenu,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import Checkpoint, open_checkpoint
from dcpstudio.core.checkpoints.model import printable

from ..compare_model import HIDDEN_AT_FIRST, ROW_ROLE, CompareModel, CompareProxy
from ..context import Context
from ..locations import accept_copy, dropped_locations, is_remote, name_of, shown
from ..notify import describe
from ..workers import Job
from .compare_sides import fill_side, side_cell, side_values, values_table

__all__ = ["CompareView", "side_values"]


class CompareView(QWidget):
    """``explore_requested(fqn)``: show an entry of A in the value explorer."""

    explore_requested = Signal(str)

    def __init__(self, ctx: Context, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.setAcceptDrops(True)
        self.b: Checkpoint | None = None
        self.focus: str | None = None  # the entry or module the comparison is restricted to
        self.a_label = QLabel("A: the open checkpoint")
        self.a_label.setTextFormat(Qt.TextFormat.PlainText)
        self.b_path = QLineEdit()
        self.b_path.setPlaceholderText("B: a checkpoint to compare with (path, Browse…, or drop it here)")
        self.b_path.returnPressed.connect(lambda: self.run())
        browse = QPushButton("Browse…")
        browse.clicked.connect(lambda: self.choose_b(False))
        browse_dir = QPushButton("Folder…")
        browse_dir.clicked.connect(lambda: self.choose_b(True))
        self.rtol = QLineEdit()
        self.rtol.setPlaceholderText("0")
        self.rtol.setToolTip("rtol: values within atol + rtol·|b| count as equal")
        self.atol = QLineEdit()
        self.atol.setPlaceholderText("0")
        self.atol.setToolTip("atol: values within atol + rtol·|b| count as equal")
        for box in (self.rtol, self.atol):
            box.setMaximumWidth(70)
            box.returnPressed.connect(lambda: self.run())
        self.run_button = QPushButton("Compare")
        self.run_button.setToolTip("Compare A and B entry by entry (Ctrl+D)")
        self.run_button.clicked.connect(lambda: self.run())
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.model = CompareModel(self)
        self.proxy = CompareProxy(self)
        self.proxy.setSourceModel(self.model)
        self.differences = QCheckBox("Differences only")
        self.differences.toggled.connect(lambda on: self.proxy.set_differences_only(on))
        self.summary = QLabel()
        self.summary.setTextFormat(Qt.TextFormat.PlainText)
        self.focus_label = QLabel()
        self.focus_label.setTextFormat(Qt.TextFormat.PlainText)
        self.focus_label.setWordWrap(True)
        self.widen_button = QPushButton("Compare Everything")
        self.widen_button.setToolTip("Compare every entry of A and B, not only the focused one")
        self.widen_button.clicked.connect(self.widen)
        self.focus_bar = QWidget()
        self.focus_bar.setObjectName("compareFocus")
        focus_lay = QHBoxLayout(self.focus_bar)
        focus_lay.setContentsMargins(0, 0, 0, 0)
        focus_lay.addWidget(self.focus_label, 1)
        focus_lay.addWidget(self.widen_button)
        self.focus_bar.setVisible(False)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(True)
        self.table.sortByColumn(-1, Qt.SortOrder.AscendingOrder)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setTabKeyNavigation(False)
        self.table.verticalHeader().setVisible(False)
        self.table.verticalHeader().setDefaultSectionSize(22)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # a name's distinctive end stays in view
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setMinimumSectionSize(40)
        for col in range(1, self.model.columnCount()):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
            self.table.setColumnHidden(col, col in HIDDEN_AT_FIRST)
        header.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        header.customContextMenuRequested.connect(self._header_menu)
        self.table.selectionModel().currentRowChanged.connect(lambda *_: self._row_selected())
        self.a_values, self.b_values = values_table(), values_table()
        self.a_caption, self.b_caption = QLabel("A"), QLabel("B")
        self.explore_button = QPushButton("Explore A's values")
        self.explore_button.clicked.connect(self._explore)
        row1 = QHBoxLayout()
        row1.addWidget(self.b_path, 1)
        row1.addWidget(browse)
        row1.addWidget(browse_dir)
        row2 = QHBoxLayout()
        row2.addWidget(QLabel("rtol"))
        row2.addWidget(self.rtol)
        row2.addWidget(QLabel("atol"))
        row2.addWidget(self.atol)
        row2.addWidget(self.run_button)
        row2.addWidget(self.cancel_button)
        row2.addWidget(self.progress, 1)
        row2.addWidget(self.differences)
        sides = QWidget()
        side_lay = QHBoxLayout(sides)
        side_lay.setContentsMargins(0, 0, 0, 0)
        for caption, table in ((self.a_caption, self.a_values), (self.b_caption, self.b_values)):
            column = QVBoxLayout()
            column.addWidget(caption)
            column.addWidget(table)
            side_lay.addLayout(column)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(sides)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        split.setSizes([260, 220])
        lay = QVBoxLayout(self)
        lay.addWidget(self.a_label)
        lay.addLayout(row1)
        lay.addLayout(row2)
        lay.addWidget(self.summary)
        lay.addWidget(self.focus_bar)
        lay.addWidget(split, 1)
        lay.addWidget(self.explore_button, 0, Qt.AlignmentFlag.AlignRight)
        self._set_busy(False)

    def _header_menu(self, pos: Any) -> None:
        menu = QMenu(self)
        for col in range(1, self.model.columnCount()):
            action = menu.addAction(str(self.model.headerData(col, Qt.Orientation.Horizontal)))
            action.setCheckable(True)
            action.setChecked(not self.table.isColumnHidden(col))
            action.toggled.connect(lambda on, c=col: self.table.setColumnHidden(c, not on))
        menu.exec(self.table.horizontalHeader().mapToGlobal(pos))

    # -- choosing B -----------------------------------------------------------------------------------
    def choose_b(self, directory: bool) -> None:
        path = self.ctx.open_path("Compare with (B)", directory)
        if path is not None:
            self.b_path.setText(str(path))
            self.run()

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        accept_copy(event)

    def dragMoveEvent(self, event: QDragMoveEvent) -> None:
        accept_copy(event)

    def dropEvent(self, event: QDropEvent) -> None:
        if accept_copy(event):
            self.b_path.setText(str(dropped_locations(event)[0]))
            self.run()

    def close_b(self) -> None:
        b, self.b = self.b, None
        if b is not None:
            b.close()

    # -- running --------------------------------------------------------------------------------------
    def _set_busy(self, busy: bool) -> None:
        self.run_button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.progress.setEnabled(busy)
        if busy:
            self.progress.setValue(0)

    @property
    def running(self) -> bool:
        job = self.ctx.board.jobs.get("compare")
        return job is not None and job.running

    def checkpoint_changed(self, ckpt: Checkpoint | None) -> None:
        """A is now ``ckpt``: earlier rows are about another checkpoint."""
        self.ctx.board.cancel("compare")
        self.ctx.board.cancel("compare-values")
        self.close_b()
        self._set_focus(None)
        self.model.clear()
        self.summary.setText("")
        self.progress.reset()  # no percentage: nothing compared with this checkpoint yet
        self.a_label.setText(f"A: {shown(ckpt.path)}" if ckpt is not None else "A: the open checkpoint")
        for t in (self.a_values, self.b_values):
            t.setRowCount(0)
            t.setColumnCount(0)

    def _set_focus(self, name: str | None) -> None:
        self.focus = name
        self.focus_bar.setVisible(name is not None)
        if name is not None:
            self.focus_label.setText(f"Only {printable(name)} (or what lies under it) is compared.")

    def widen(self) -> Job | None:
        """Compare Everything: the same A and B, every entry."""
        self._set_focus(None)
        return self.run()

    def run(self, b_path: Path | None = None, only: str | None = None) -> Job | None:
        """Compare A with ``b_path`` (or the B given before); ``only``: focus on that entry or module
        (see the module docstring), which stays until widened."""
        a = self.ctx.checkpoint()
        if a is None:
            self.ctx.notifier.info("Open a checkpoint first: it is A, the one B is compared with.")
            return None
        if b_path is not None:
            self.b_path.setText(str(b_path))
        text = self.b_path.text().strip()
        if not text:
            self.choose_b(False)
            return None
        try:
            rtol = float(self.rtol.text() or 0)
            atol = float(self.atol.text() or 0)
            if not (rtol >= 0 and atol >= 0):
                raise ValueError
        except ValueError:
            self.ctx.notifier.info("Tolerances are numbers ≥ 0, e.g. rtol 1e-3, atol 1e-6.")
            return None
        b = text if is_remote(text) else Path(text).expanduser()  # a URL is opened by the worker
        if only is not None:
            self._set_focus(only)
        focus = self.focus
        self.model.clear()
        self.summary.setText(f"Comparing with {name_of(b)}…")
        self._set_busy(True)
        self.ctx.board.cancel("compare-values")
        self.close_b()

        def work(progress: Any, cancel: Any) -> tuple[Checkpoint, list[Any]]:
            from dcpstudio.core.ops.compare.diff import compare

            other = open_checkpoint(b)
            progress(("opened", other))  # B's values can be shown while the comparison runs
            try:
                rows = compare(
                    a, other, rtol=rtol, atol=atol, progress=progress, cancel=cancel, on_entry=progress, only=focus
                )
            except BaseException:
                if cancel.cancelled:
                    other.close()
                raise
            return other, rows

        def done(result: tuple[Checkpoint, list[Any]]) -> None:
            self.progress.setValue(self.progress.maximum())
            self._summarise(result[1])
            if focus is not None and focus == self.focus:
                if not result[1]:
                    self.summary.setText(f"Neither A nor B holds {printable(focus)} or anything under it.")
                elif not self.select(focus):
                    self.select(result[1][0].fqn)  # a module: its first entry

        job = self.ctx.start("compare", work, done, lambda: self._set_busy(False), self._progress)
        job.cancelled.connect(lambda: self._stopped(a, f"Cancelled after {self.model.rowCount():,} entries."))
        job.errored.connect(lambda e: self._stopped(a, f"Not compared: {describe(e)}"))
        return job

    def _stopped(self, a: Checkpoint, text: str) -> None:
        if a is not self.ctx.checkpoint():
            return  # cancelled because A was closed: the view is about another checkpoint now
        self.progress.reset()
        self.summary.setText(text)

    def _progress(self, p: Any) -> None:
        if isinstance(p, tuple) and len(p) == 2 and p[0] == "opened":
            self.b = p[1]
        elif hasattr(p, "fqn") and hasattr(p, "status"):
            self.model.append(p)
        elif hasattr(p, "fraction"):
            self.progress.setValue(int(p.fraction * 1000))

    def _summarise(self, rows: list[Any]) -> None:
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        from ..compare_model import STATUS_TEXT

        parts = [f"{n:,} {STATUS_TEXT.get(k, k)}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
        self.summary.setText(f"{len(rows):,} entries: " + ", ".join(parts))

    def cancel(self) -> None:
        self.ctx.board.cancel("compare")

    # -- one entry, side by side ----------------------------------------------------------------------
    def select(self, fqn: str) -> bool:
        """Select the row of entry ``fqn`` (its values are shown side by side); False when none."""
        for row in range(self.proxy.rowCount()):
            r = self.proxy.index(row, 0).data(ROW_ROLE)
            if r is not None and r.fqn == fqn:
                self.table.selectRow(row)
                self.table.scrollTo(self.proxy.index(row, 0))
                self.table.setFocus(Qt.FocusReason.OtherFocusReason)
                return True
        return False

    def selected_fqn(self) -> str | None:
        index = self.table.currentIndex()
        row = index.siblingAtColumn(0).data(ROW_ROLE) if index.isValid() else None
        return row.fqn if row is not None else None

    def _row_selected(self) -> None:
        fqn = self.selected_fqn()
        a, b = self.ctx.checkpoint(), self.b
        if fqn is None:
            return
        self.a_caption.setText(f"A: {printable(fqn)} (reading…)")
        self.b_caption.setText("B")

        def work(progress: Any, cancel: Any) -> tuple[Any, Any]:
            return side_values(a, fqn), side_values(b, fqn)

        def done(result: tuple[Any, Any]) -> None:
            if fqn != self.selected_fqn():
                return
            entry = a.entries.get(fqn) if a is not None else None
            row = self.table.currentIndex().siblingAtColumn(0).data(ROW_ROLE)
            first = getattr(row, "first_index", None)
            mark = side_cell(len(entry.shape or ()), first) if entry is not None and entry.kind == "tensor" else None
            for (cells, caption), table, label, name in (
                (result[0], self.a_values, self.a_caption, "A"),
                (result[1], self.b_values, self.b_caption, "B"),
            ):
                label.setText(f"{name}: {caption}")
                fill_side(table, cells, mark, first)

        self.ctx.start("compare-values", work, done)

    def _explore(self) -> None:
        fqn = self.selected_fqn()
        if fqn is not None:
            self.explore_requested.emit(fqn)
