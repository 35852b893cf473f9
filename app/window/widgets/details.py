"""The details area: a summary of the checkpoint when nothing is selected; for a selected entry or
group its properties, its chunk table and drawing (tensors), and a preview of values with stats and
a histogram, which the window computes in a worker and hands over with :meth:`show_preview`."""

from __future__ import annotations

import contextlib
import html
import math
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QScrollArea,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import Checkpoint, Chunk, Node, TensorStats, tensor_stats
from dcpstudio.core.checkpoints.model import Entry, Totals, dtype_name, printable, short_repr
from dcpstudio.core.ops.explore.slices import cell_note, display_cells
from dcpstudio.core.ops.report import exact_count, human_bytes, human_count

from ..context import Context
from ..kinds import kind_text
from ..locations import is_remote, name_of
from ..notify import describe
from ..tree_filter import totals_by_kind
from .drawing import ChunkDrawing, Histogram
from .pane_error import PaneError

__all__ = ["DetailsPanel", "Preview", "elements_text", "preview_values", "slice_label"]


_PREVIEW = 12


def slice_label(shape: tuple[int, ...], region: list[slice]) -> str:
    """``[0:12, 0:12, 0, 0]``: which part of a tensor a preview shows."""
    parts = []
    for size, sl in zip(shape, region, strict=True):
        start, stop, _ = sl.indices(size)
        parts.append(str(start) if stop - start == 1 and size > 1 else f"{start}:{stop}")
    return "[" + ", ".join(parts) + "]"


Preview = tuple[Any, str]  # values (nested lists of numbers, or a value), what part of the entry they are


def preview_values(ckpt: Checkpoint, fqn: str) -> Preview:
    """The first values of an entry and a caption saying which (runs on a worker: it reads, with torch)."""
    entry = ckpt.entries[fqn]
    if entry.kind != "tensor":
        value = ckpt.read_value(fqn)
        return value, f"the {kind_text(entry, value)}"  # "Showing the value (int)", as Kind says
    shape = tuple(entry.shape or ())
    region = [slice(0, min(_PREVIEW, s) if i < 2 else min(1, s)) for i, s in enumerate(shape)]
    t = ckpt.read_tensor(fqn, region)
    if t.dim() > 2:
        t = t.reshape(t.shape[0], t.shape[1])
    caption = "the value" if not shape else f"values{slice_label(shape, region)} of shape {list(shape)}"
    note = cell_note(entry.dtype)
    return display_cells(t), caption + (f" ({note})" if note else "")


def _table(headers: list[str]) -> QTableWidget:
    t = QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(headers)
    t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    t.verticalHeader().setVisible(False)
    t.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    t.setTabKeyNavigation(False)  # Tab moves on to the next control, not cell to cell
    t.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    return t


def _fill(table: QTableWidget, rows: list[list[Any]]) -> None:
    table.setRowCount(len(rows))
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            table.setItem(r, c, QTableWidgetItem("" if value is None else str(value)))


def _fit_height(table: QTableWidget, most: int = 8) -> None:
    rows = min(table.rowCount(), most)
    h = table.horizontalHeader().height() + 2 * table.frameWidth() + 4
    table.setFixedHeight(h + sum(table.rowHeight(r) for r in range(rows)))


class DetailsPanel(QStackedWidget):
    """``explore_requested(fqn)``: the user asked to page through an entry's values."""

    explore_requested = Signal(str)

    def __init__(self, ctx: Context, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctx = ctx
        # summary page
        self.summary_title = QLabel("Open a checkpoint: drop it here, or use File ▸ Open.")
        self.summary_title.setWordWrap(True)
        self.by_dtype = _table(["dtype / kind", "entries", "params", "bytes"])
        self.by_prefix = _table(["prefix", "entries", "params", "bytes"])
        summary = QWidget()
        lay = QVBoxLayout(summary)
        lay.addWidget(self.summary_title)
        lay.addWidget(QLabel("Totals by dtype"))
        lay.addWidget(self.by_dtype)
        lay.addWidget(QLabel("Totals by top-level prefix"))
        lay.addWidget(self.by_prefix)
        self.addWidget(summary)
        # entry page
        self.props = QFormLayout()
        self.prop_labels: dict[str, QLabel] = {}
        for key in ("Name", "Kind", "Dtype", "Shape", "Elements", "Size", "Stored", "Shared with", "Value"):
            label = QLabel()
            label.setTextFormat(Qt.TextFormat.PlainText)  # names and values come from the file: never markup
            label.setWordWrap(True)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.prop_labels[key] = label
            self.props.addRow(key, label)
        self.group_table = _table(["dtype / kind", "entries", "params", "bytes"])
        self.chunks_label = QLabel("Chunks")
        self.chunk_table = _table(["offsets", "sizes", "file", "offset", "length", "data offset"])
        self.drawing = ChunkDrawing()
        self.preview_caption = QLabel()
        self.preview_caption.setTextFormat(Qt.TextFormat.PlainText)
        self.explore_button = QPushButton("Explore values…")
        self.explore_button.setToolTip("Page through any 2-D slice, heatmap, copy as CSV, export (Ctrl+E)")
        self.explore_button.clicked.connect(lambda: self.explore_requested.emit(self.current or ""))
        self.preview = _table([])
        self.preview.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectItems)
        self.preview.setMinimumHeight(160)
        self.stats_label = QLabel()
        self.stats_label.setWordWrap(True)
        self.histogram = Histogram()
        self.read_error = PaneError()
        entry = QWidget()
        lay = QVBoxLayout(entry)
        box = QGroupBox("Properties")
        box.setLayout(self.props)
        lay.addWidget(box)
        lay.addWidget(self.group_table)
        lay.addWidget(self.chunks_label)
        lay.addWidget(self.chunk_table)
        lay.addWidget(self.drawing)
        self.values_box = QGroupBox("Values")
        vlay = QVBoxLayout(self.values_box)
        head = QHBoxLayout()
        head.addWidget(self.preview_caption, 1)
        head.addWidget(self.explore_button)
        vlay.addLayout(head)
        vlay.addWidget(self.read_error)
        vlay.addWidget(self.preview)
        vlay.addWidget(self.stats_label)
        vlay.addWidget(self.histogram)
        lay.addWidget(self.values_box)
        lay.addStretch(1)
        self.scroll_area = QScrollArea()
        self.scroll_area.setWidgetResizable(True)
        self.scroll_area.setWidget(entry)
        self.addWidget(self.scroll_area)
        self.current: str | None = None
        self._entry: Entry | None = None
        self._shown: tuple[Checkpoint, Node, dict[str, Totals] | None] | None = None  # the summary's tree

    def show_summary(
        self, ckpt: Checkpoint | None, by_kind: dict[str, Totals] | None = None, root: Node | None = None
    ) -> None:
        """The checkpoint's totals: of ``root``, the tree shown (kept for later calls; a large DCP's
        tree from its head asks for no storage index, as ``ckpt.tree`` would), by kind ``by_kind``."""
        self.current = None
        self.setCurrentIndex(0)
        if ckpt is None:
            self._shown = None  # the last one shown is closed: not kept
            self.summary_title.setText("Open a checkpoint: drop it here, or use File ▸ Open.")
            _fill(self.by_dtype, [])
            _fill(self.by_prefix, [])
            return
        if root is not None:
            self._shown = (ckpt, root, by_kind)
        elif self._shown is not None and self._shown[0] is ckpt:
            _, root, by_kind = self._shown
        root = root or ckpt.tree
        by_dtype = by_kind if by_kind is not None else totals_by_kind(root.walk())
        tensors = sum(t.count for k, t in by_dtype.items() if k != "value")
        t = root.totals
        self.summary_title.setText(
            f"<b>{html.escape(printable(name_of(ckpt.path)))}</b> — {ckpt.format}, {exact_count(tensors)} tensors "
            f"({human_count(t.params)} parameters, {human_bytes(t.tensor_bytes)}), "
            f"{exact_count(t.count - tensors)} other values"
        )
        _fill(self.by_dtype, _rows(by_dtype))
        _fill(self.by_prefix, _rows({printable(k): n.totals for k, n in root.children.items()}))

    def show_selection(self, ckpt: Checkpoint | None, node: Node | None) -> None:
        """Show what is selected: the summary for nothing, else the node, then (from a worker) its
        values, statistics and resolved chunk offsets."""
        if ckpt is None or node is None:
            self.show_summary(ckpt)
            return
        entry = node.entry
        remote = is_remote(ckpt.path)  # listing a remote checkpoint's chunks may ask the store: worker only
        try:
            local = entry is not None and not remote and ckpt.index_ready()  # else: from the worker, below
            chunks = ckpt.chunks(entry.fqn) if local and entry is not None else []
        except Exception as e:  # a damaged entry: say so, show what the model knows
            self.ctx.notifier.error(e)
            chunks = []
        self.show_node(ckpt, node, chunks)
        if entry is None:
            if node.totals.count > _GROUP_WALK:  # a large group's breakdown is read off the GUI thread
                self.ctx.start(
                    "preview",
                    lambda p, c: _rows(totals_by_kind(node.walk())),
                    lambda rows: self._group_rows(node, rows),
                )
            return
        fqn, tensor = entry.fqn, entry.kind == "tensor"

        def work(progress: Any, cancel: Any) -> tuple[str, Any, Any, Any]:
            values = preview_values(ckpt, fqn)
            stats = tensor_stats(ckpt, fqn, progress=progress, cancel=cancel) if tensor else None
            try:
                resolved = ckpt.resolve_chunks(fqn) if tensor else (ckpt.chunks(fqn) if remote else [])
            except Exception as e:  # the values are shown; the chunk layout is not (as in show_selection)
                return fqn, values, stats, e
            return fqn, values, stats, resolved

        def done(result: tuple[str, Any, Any, Any]) -> None:
            fqn, values, stats, resolved = result
            if isinstance(resolved, Exception):
                if remote:  # a local checkpoint's failure was reported by show_selection already
                    self.ctx.notifier.error(resolved)
                resolved = []
            if resolved and self.current == fqn:
                self.show_node(ckpt, node, resolved, keep_scroll=True)
            self.show_preview(fqn, values, stats)

        job = self.ctx.start("preview", work, done)
        job.errored.connect(lambda e: self._read_failed(fqn, e, lambda: self.show_selection(ckpt, node)))

    def _read_failed(self, fqn: str, exc: BaseException, retry: Callable[[], None]) -> None:
        """The values could not be read: said here, with Retry, instead of "reading…" for ever."""
        if fqn == self.current:
            self.preview_caption.setText("")
            self.stats_label.setText("")
            self.read_error.show_error(f"Not read: {describe(exc)}", retry)

    def _group_rows(self, node: Node, rows: list[list[Any]]) -> None:
        if self.current is None and self.prop_labels["Name"].text() == printable(node.path or node.name):
            _fill(self.group_table, rows)
            _fit_height(self.group_table)

    def show_node(self, ckpt: Checkpoint, node: Node, chunks: list[Chunk], *, keep_scroll: bool = False) -> None:
        """Properties and chunk layout (cheap, from the model); values follow via show_preview.
        A new selection starts at the top of the page."""
        e = node.entry
        self.setCurrentIndex(1)
        if not keep_scroll:
            self.scroll_area.verticalScrollBar().setValue(0)
        self.current, self._entry = (e.fqn if e is not None else None), e
        values = dict.fromkeys(self.prop_labels, "")
        values["Name"] = printable(node.path or node.name)
        agg = node.totals
        if e is None:
            values["Kind"] = f"group of {exact_count(agg.count)} entries"
            values["Elements"] = f"{elements_text(agg.params)} in its tensors"
            values["Size"] = human_bytes(agg.tensor_bytes)
        else:
            values["Kind"] = kind_text(e)
            values["Dtype"] = dtype_name(e.dtype) or ""
            values["Shape"] = str(list(e.shape)) if e.shape is not None else ""
            if e.shard_of is not None:
                values["Shape"] += f" — a shard, at {list(e.shard_of[0])} of a larger tensor"
            if e.kind == "tensor":
                values["Elements"] = elements_text(e.numel)
                values["Size"] = human_bytes(e.nbytes)
            if e.storage is not None:
                values["Stored"] = f"record data/{e.storage}, offset {e.storage_offset}, stride {list(e.stride or ())}"
            elif e.kind == "bytes":
                values["Stored"] = (
                    f"a pickle of {human_bytes(e.byte_size)} in {chunks[0].file if chunks else 'a data file'}"
                )
            elif e.kind == "object":
                values["Stored"] = "in the checkpoint's pickle"
            values["Shared with"] = printable(", ".join(e.shared_with))
            if e.kind == "object":
                values["Value"] = short_repr(e.value, 400)
        for key, label in self.prop_labels.items():
            label.setText(values[key])
            self.props.setRowVisible(label, bool(values[key]))
        group = e is None or bool(node.children)
        self.group_table.setVisible(group)
        if group:
            _fill(self.group_table, _rows(totals_by_kind(node.walk())) if agg.count <= _GROUP_WALK else [])
            _fit_height(self.group_table)
        self._show_chunks(ckpt, e, chunks)
        self.values_box.setVisible(e is not None)
        self.explore_button.setVisible(e is not None and e.kind == "tensor")
        self.preview.clear()
        self.preview.setRowCount(0)
        self.preview.setColumnCount(0)
        self.read_error.clear()
        self.preview_caption.setText("reading…" if e is not None else "")
        self.stats_label.setText("computing…" if e is not None and e.kind == "tensor" else "")
        self.histogram.set_data([], [])

    def _show_chunks(self, ckpt: Checkpoint, e: Entry | None, chunks: list[Chunk]) -> None:
        tensor_chunks = chunks if e is not None and e.kind == "tensor" else []
        _fill(
            self.chunk_table,
            [[list(c.offsets), list(c.sizes), c.file, c.offset, c.length, c.data_offset] for c in tensor_chunks],
        )
        _fit_height(self.chunk_table, 6)
        for w in (self.chunks_label, self.chunk_table):
            w.setVisible(bool(tensor_chunks))
        root = None if is_remote(ckpt.path) else ckpt.path  # a store's file sizes: not asked on this thread
        self.drawing.set_chunks(e.shape or () if e is not None else (), tensor_chunks, root)
        self.drawing.setVisible(bool(tensor_chunks))

    def follow_index(self, ckpt: Checkpoint, node: Callable[[], Node | None]) -> None:
        """Read ``ckpt``'s storage index (a large DCP shown from its ``.metadata``'s head) on a worker;
        then the selected tensor (``node()``), shown without its chunks meanwhile, gets them. A refusal
        is the window's to handle (job kind "index")."""
        if ckpt.index_ready():
            return

        def indexed(_: Any) -> None:
            n = node()
            e = n.entry if n is not None else None
            if e is not None and e.kind == "tensor" and self.current == e.fqn and not self.chunk_table.rowCount():
                with contextlib.suppress(Exception):  # a damaged entry: selecting it again explains
                    self._show_chunks(ckpt, e, ckpt.chunks(e.fqn))

        self.ctx.start("index", lambda progress, cancel: ckpt.wait_index(), indexed)

    def show_preview(self, fqn: str, preview: Preview, stats: TensorStats | None) -> None:
        if fqn != self.current:
            return  # the selection moved on while the worker ran
        values, caption = preview
        self.preview_caption.setText(f"Showing {caption}")
        if isinstance(values, list):
            rows = values if values and isinstance(values[0], list) else [values]
            self.preview.setColumnCount(max((len(r) for r in rows), default=0))
            self.preview.setHorizontalHeaderLabels([str(i) for i in range(self.preview.columnCount())])
            _fill(self.preview, [[_fmt(v) for v in r] for r in rows])
        else:
            self.preview.setColumnCount(1)
            self.preview.setHorizontalHeaderLabels(["value"])
            packed = isinstance(values, tuple) and self._entry is not None and self._entry.kind == "tensor"
            _fill(self.preview, [[_fmt(values) if packed else short_repr(values, 500)]])
            self.prop_labels["Value"].setText(_fmt(values) if packed else short_repr(values, 400))
            if self._entry is not None:  # a 0-d tensor's preview is a number: it stays "tensor"
                self.prop_labels["Kind"].setText(kind_text(self._entry, values))
            self.props.setRowVisible(self.prop_labels["Value"], True)
        if stats is None:
            self.stats_label.setText("")
            return
        self.stats_label.setText(
            f"min {stats.min:.6g} · max {stats.max:.6g} · mean {stats.mean:.6g} · std {stats.std:.6g} · "
            f"NaN {exact_count(stats.nan)} · +Inf {exact_count(stats.posinf)} · −Inf {exact_count(stats.neginf)} · "
            f"zeros {exact_count(stats.zeros)}" + (f" ({stats.note})" if stats.note else "")
        )
        self.histogram.set_data(stats.hist_edges, stats.hist_counts)


_GROUP_WALK = 20_000  # entries below a group whose dtype breakdown is worth a walk on the GUI thread


def _rows(totals: dict[str, Totals]) -> list[list[Any]]:
    """Table rows (name, entries, params, tensor bytes), largest first."""
    ordered = sorted(totals.items(), key=lambda kv: (-kv[1].tensor_bytes, -kv[1].count))
    return [[k, exact_count(t.count), human_count(t.params), human_bytes(t.tensor_bytes)] for k, t in ordered]


def elements_text(n: int) -> str:
    """A magnitude in the one number style, exact beside it once it is rounded: ``3.2 K (3,200)``."""
    short = human_count(n)
    return short if short == exact_count(n) else f"{short} ({exact_count(n)})"


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):  # a packed element's values (display_cells), as the Values tab shows them
        return " | ".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return str(v)
