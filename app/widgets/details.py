"""The details area: a summary of the checkpoint when nothing is selected; for a selected entry
its properties, chunk table and drawing, and (for tensors) a preview of values, stats and a
histogram, which the window computes in a worker and hands over with :meth:`show_preview`."""

from __future__ import annotations

import html
import math
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QHeaderView,
    QLabel,
    QScrollArea,
    QStackedWidget,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import Checkpoint, Chunk, Node, TensorStats
from dcpstudio.core.model import dtype_name, printable, short_repr
from dcpstudio.core.report import human_bytes

from .drawing import ChunkDrawing, Histogram

__all__ = ["DetailsPanel", "preview_values"]


_PREVIEW = 12


def preview_values(ckpt: Checkpoint, fqn: str) -> Any:
    """The first values of an entry, as lists of numbers (runs on a worker: it reads, with torch)."""
    entry = ckpt.entries[fqn]
    if entry.kind != "tensor":
        return ckpt.read_value(fqn)
    shape = entry.shape or ()
    region = [slice(0, _PREVIEW if i < 2 else 1) for i in range(len(shape))]
    t = ckpt.read_tensor(fqn, region)
    if t.dtype.is_floating_point and t.dtype.itemsize < 4:  # bf16, fp16 and fp8 print as float32
        t = t.float()
    if t.dim() > 2:
        t = t.reshape(t.shape[0], t.shape[1])
    return t.tolist()


def _table(headers: list[str]) -> QTableWidget:
    t = QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(headers)
    t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    t.verticalHeader().setVisible(False)
    t.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    return t


def _fill(table: QTableWidget, rows: list[list[Any]]) -> None:
    table.setRowCount(len(rows))
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            table.setItem(r, c, QTableWidgetItem("" if value is None else str(value)))


class DetailsPanel(QStackedWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        # summary page
        self.summary_title = QLabel("Open a checkpoint: drop it here, or use File ▸ Open.")
        self.summary_title.setWordWrap(True)
        self.by_dtype = _table(["dtype / kind", "entries", "bytes"])
        self.by_prefix = _table(["prefix", "entries", "bytes"])
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
        for key in ("Name", "Kind", "Dtype", "Shape", "Elements", "Size", "Storage", "Shared with", "Value"):
            label = QLabel()
            label.setTextFormat(Qt.TextFormat.PlainText)  # names and values come from the file: never markup
            label.setWordWrap(True)
            label.setTextInteractionFlags(
                label.textInteractionFlags() | label.textInteractionFlags().TextSelectableByMouse
            )
            self.prop_labels[key] = label
            self.props.addRow(key, label)
        self.chunk_table = _table(["offsets", "sizes", "file", "offset", "length", "data offset"])
        self.chunk_table.setMaximumHeight(150)
        self.drawing = ChunkDrawing()
        self.preview = _table([])
        self.preview.setMinimumHeight(160)
        self.stats_label = QLabel()
        self.stats_label.setWordWrap(True)
        self.histogram = Histogram()
        entry = QWidget()
        lay = QVBoxLayout(entry)
        box = QGroupBox("Properties")
        box.setLayout(self.props)
        lay.addWidget(box)
        lay.addWidget(QLabel("Chunks"))
        lay.addWidget(self.chunk_table)
        lay.addWidget(self.drawing)
        self.values_box = QGroupBox("Values")
        vlay = QVBoxLayout(self.values_box)
        vlay.addWidget(self.preview)
        vlay.addWidget(self.stats_label)
        vlay.addWidget(self.histogram)
        lay.addWidget(self.values_box)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(entry)
        self.addWidget(scroll)
        self.current: str | None = None

    def show_summary(self, ckpt: Checkpoint | None) -> None:
        self.current = None
        self.setCurrentIndex(0)
        if ckpt is None:
            self.summary_title.setText("Open a checkpoint: drop it here, or use File ▸ Open.")
            _fill(self.by_dtype, [])
            _fill(self.by_prefix, [])
            return
        tensors = sum(1 for e in ckpt.entries.values() if e.kind == "tensor")
        self.summary_title.setText(
            f"<b>{html.escape(printable(ckpt.path.name))}</b> — {ckpt.format}, {tensors} tensors, "
            f"{len(ckpt.entries) - tensors} other values, {human_bytes(ckpt.tensor_bytes)}"
        )
        _fill(self.by_dtype, [[k, t.count, human_bytes(t.nbytes)] for k, t in ckpt.totals_by_dtype().items()])
        _fill(
            self.by_prefix,
            [[printable(k), t.count, human_bytes(t.nbytes)] for k, t in ckpt.totals_by_prefix().items()],
        )

    def show_node(self, ckpt: Checkpoint, node: Node, chunks: list[Chunk]) -> None:
        """Properties and chunk layout (cheap, from the model); values follow via show_preview."""
        e = node.entry
        self.setCurrentIndex(1)
        self.current = node.path
        values = {k: "" for k in self.prop_labels}
        values["Name"] = printable(node.path or node.name)
        values["Size"] = human_bytes(node.totals.nbytes)
        if e is None:
            values["Kind"] = f"group of {node.totals.count} entries"
        else:
            values["Kind"] = e.kind
            values["Dtype"] = dtype_name(e.dtype) or ""
            values["Shape"] = str(list(e.shape)) if e.shape is not None else ""
            if e.shard_of is not None:
                values["Shape"] += f" — a shard, at {list(e.shard_of[0])} of a larger tensor"
            values["Elements"] = f"{e.numel:,}" if e.kind == "tensor" else ""
            if e.storage is not None:
                values["Storage"] = f"record data/{e.storage}, offset {e.storage_offset}, stride {list(e.stride or ())}"
            values["Shared with"] = printable(", ".join(e.shared_with))
            if e.kind == "object":
                values["Value"] = short_repr(e.value, 400)
        for key, label in self.prop_labels.items():
            label.setText(values[key])
        _fill(
            self.chunk_table,
            [[list(c.offsets), list(c.sizes), c.file, c.offset, c.length, c.data_offset] for c in chunks],
        )
        self.drawing.set_chunks(e.shape or () if e is not None else (), chunks, ckpt.path)
        self.drawing.setVisible(bool(chunks))
        self.values_box.setVisible(e is not None and e.kind != "object")
        self.preview.clear()
        self.preview.setRowCount(0)
        self.preview.setColumnCount(0)
        self.stats_label.setText("computing…" if e is not None and e.kind == "tensor" else "")
        self.histogram.set_data([], [])

    def show_preview(self, fqn: str, values: Any, stats: TensorStats | None) -> None:
        if fqn != self.current:
            return  # the selection moved on while the worker ran
        if isinstance(values, list):
            rows = values if values and isinstance(values[0], list) else [values]
            self.preview.setColumnCount(max((len(r) for r in rows), default=0))
            self.preview.setHorizontalHeaderLabels([str(i) for i in range(self.preview.columnCount())])
            _fill(self.preview, [[_fmt(v) for v in r] for r in rows])
        else:
            self.preview.setColumnCount(1)
            self.preview.setHorizontalHeaderLabels(["value"])
            _fill(self.preview, [[short_repr(values, 500)]])
        if stats is None:
            self.stats_label.setText("")
            return
        self.stats_label.setText(
            f"min {stats.min:.6g} · max {stats.max:.6g} · mean {stats.mean:.6g} · std {stats.std:.6g} · "
            f"NaN {stats.nan:,} · +Inf {stats.posinf:,} · −Inf {stats.neginf:,} · zeros {stats.zeros:,}"
            + (f" ({stats.note})" if stats.note else "")
        )
        self.histogram.set_data(stats.hist_edges, stats.hist_counts)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return str(v)
