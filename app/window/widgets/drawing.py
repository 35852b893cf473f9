"""Painted views: a tensor's chunk layout (boxes in its shape, byte ranges in its files), a
histogram and a heatmap of a slice. All are plain QWidgets fed with core data; they read nothing."""

from __future__ import annotations

import math
import os
from pathlib import Path

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QImage, QMouseEvent, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QPushButton, QSizePolicy, QWidget

from dcpstudio.core import Chunk
from dcpstudio.core.ops.explore.slices import SliceSummary
from dcpstudio.core.ops.report import exact_count, human_bytes

from ..axes import count_ticks, tick_text, value_ticks

__all__ = ["ChunkDrawing", "DrawButton", "Heatmap", "Histogram", "count_ticks", "heat_colour"]

_PALETTE = ["#f97316", "#3b82f6", "#10b981", "#a855f7", "#ef4444", "#eab308", "#06b6d4", "#ec4899"]


class ChunkDrawing(QWidget):
    """Top: the tensor (first two dimensions) with each chunk as a box, coloured by file.
    Bottom: one bar per file with the byte ranges its chunks occupy."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.shape: tuple[int, ...] = ()
        self.chunks: list[Chunk] = []
        self.file_sizes: dict[str, int] = {}
        self.files: list[str] = []  # colours follow the data files, also where their sizes are unknown
        self.setMinimumHeight(240)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)

    def set_chunks(self, shape: tuple[int, ...], chunks: list[Chunk], root: Path | None) -> None:
        """``root``: the checkpoint's local path, for the files' bars; ``None`` draws the chunks only
        (a remote store is not asked for file sizes on the GUI thread)."""
        self.shape, self.chunks = shape, chunks
        self.files = sorted({c.file for c in chunks if c.file})
        self.file_sizes = {}
        for c in chunks:
            if c.file and root is not None and c.file not in self.file_sizes:
                base = root if root.is_dir() else root.parent
                try:
                    self.file_sizes[c.file] = os.stat(base / c.file).st_size
                except OSError:
                    self.file_sizes[c.file] = 0
        self.update()

    def colour(self, file: str | None) -> QColor:
        if file is None or file not in self.files:
            return QColor("#9ca3af")
        return QColor(_PALETTE[self.files.index(file) % len(_PALETTE)])

    def paintEvent(self, event: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        w, h = self.width(), self.height()
        bars = len(self.file_sizes)
        # the first two dimensions, stretched to the space available (dimension 0 downwards)
        box_h = max(40.0, h - 24.0 * bars - 28)
        rows = self.shape[0] if self.shape else 1
        cols = self.shape[1] if len(self.shape) > 1 else 1
        ox, oy = 8.0, 8.0
        sx, sy = (w - 16) / max(cols, 1), box_h / max(rows, 1)
        p.setPen(QPen(QColor("#6b7280"), 1))
        p.drawRect(QRectF(ox, oy, cols * sx, rows * sy))
        for c in self.chunks:
            r0 = c.offsets[0] if c.offsets else 0
            c0 = c.offsets[1] if len(c.offsets) > 1 else 0
            nr = c.sizes[0] if c.sizes else 1
            nc = c.sizes[1] if len(c.sizes) > 1 else 1
            colour = self.colour(c.file)
            colour.setAlpha(150)
            p.setBrush(colour)
            p.setPen(QPen(QColor("#111827"), 1))
            rect = QRectF(ox + c0 * sx, oy + r0 * sy, nc * sx, nr * sy)
            p.drawRect(rect)
            label = f"rows {r0}–{r0 + nr}" + (f", cols {c0}–{c0 + nc}" if len(c.sizes) > 1 else "")
            if rect.height() >= 14 and rect.width() >= 90:
                p.drawText(rect, Qt.AlignmentFlag.AlignCenter, label)
        p.setPen(QPen(QColor("#6b7280"), 1))
        dims = " × ".join(map(str, self.shape)) or "scalar"
        p.drawText(QRectF(ox, oy + rows * sy + 2, w - 16, 14), Qt.AlignmentFlag.AlignLeft, f"shape {dims}")
        y = oy + rows * sy + 22
        for file, size in sorted(self.file_sizes.items()):
            p.setPen(QPen(QColor("#6b7280"), 1))
            p.setBrush(Qt.BrushStyle.NoBrush)
            bar = QRectF(ox + 110, y, w - ox - 118, 14)
            p.drawRect(bar)
            p.drawText(QRectF(ox, y - 1, 106, 16), Qt.AlignmentFlag.AlignLeft, file)
            for c in self.chunks:
                if c.file == file and size and c.offset is not None and c.length is not None:
                    p.setBrush(self.colour(file))
                    p.setPen(Qt.PenStyle.NoPen)
                    x0 = bar.x() + bar.width() * c.offset / size
                    p.drawRect(QRectF(x0, y + 1, max(1.5, bar.width() * c.length / size), 12))
            y += 24
        p.end()


class Histogram(QWidget):
    """Bars of a histogram with a count axis (left), a value axis (below) and, under the mouse,
    the bin's range and count."""

    _BOTTOM, _TOP = 20.0, 10.0  # room for the value labels below, half a count label above

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.counts: list[int] = []
        self.edges: list[float] = []
        self.setMinimumHeight(110)
        self.setMouseTracking(True)

    def set_data(self, edges: list[float], counts: list[int]) -> None:
        self.edges, self.counts = edges, counts
        self.setToolTip("")
        self.update()

    @property
    def left_margin(self) -> float:
        """Room for the widest count label (1,374,862 is never cut to 374,862)."""
        fm = self.fontMetrics()
        widest = max(fm.horizontalAdvance(exact_count(t)) for t in count_ticks(max(self.counts, default=0)))
        return max(40.0, widest + 12.0)

    def _plot(self) -> QRectF:
        left = self.left_margin
        return QRectF(
            left,
            self._TOP,
            max(10.0, self.width() - left - 8),
            max(10.0, self.height() - self._TOP - self._BOTTOM),
        )

    def count_labels(self) -> list[tuple[float, QRectF, str]]:
        """The count axis: (y, label box, text) per tick, the boxes inside the widget."""
        plot = self._plot()
        top = max(self.counts, default=0) or 1
        h = float(self.fontMetrics().height())
        out = []
        for tick in count_ticks(max(self.counts, default=0)):
            y = plot.bottom() - plot.height() * tick / top
            box = QRectF(0, min(max(0.0, y - h / 2), self.height() - h), plot.left() - 6, h)
            out.append((y, box, exact_count(tick)))
        return out

    def value_labels(self) -> list[tuple[float, QRectF, str]]:
        """The value axis: (x, label box, text) per round tick between the first and last edge;
        as many as fit without touching, the boxes inside the widget."""
        if len(self.edges) < 2:
            return []
        plot, fm = self._plot(), self.fontMetrics()
        lo, hi = self.edges[0], self.edges[-1]
        most = 6
        while True:
            ticks, step = value_ticks(lo, hi, most)
            texts = [tick_text(t, step) for t in ticks]
            widths = [fm.horizontalAdvance(t) + 8.0 for t in texts]
            spacing = plot.width() * step / (hi - lo) if step > 0 and hi > lo else plot.width()
            if most == 1 or max(widths, default=0.0) <= spacing:
                break
            most -= 1
        out = []
        for t, text, w in zip(ticks, texts, widths, strict=True):
            x = plot.left() + plot.width() * (t - lo) / (hi - lo) if hi > lo else plot.left()
            left = min(max(0.0, x - w / 2), self.width() - w)
            out.append((x, QRectF(left, plot.bottom() + 3, w, fm.height()), text))
        return out

    def bin_at(self, x: float) -> int | None:
        plot = self._plot()
        if not self.counts or not plot.left() <= x < plot.right():
            return None
        return min(len(self.counts) - 1, int((x - plot.left()) / plot.width() * len(self.counts)))

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        i = self.bin_at(event.position().x())
        if i is None:
            self.setToolTip("")
            return
        self.setToolTip(f"[{self.edges[i]:.6g}, {self.edges[i + 1]:.6g}): {exact_count(self.counts[i])} values")

    def paintEvent(self, event: QPaintEvent) -> None:
        if not self.counts or len(self.edges) != len(self.counts) + 1:
            return
        p = QPainter(self)
        plot = self._plot()
        top = max(self.counts) or 1
        step = plot.width() / len(self.counts)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(QColor("#3b82f6"))
        for i, c in enumerate(self.counts):
            bh = plot.height() * c / top
            p.drawRect(QRectF(plot.left() + i * step, plot.bottom() - bh, max(step - 1, 1), bh))
        p.setPen(QPen(QColor("#6b7280")))
        p.drawLine(plot.bottomLeft(), plot.bottomRight())
        p.drawLine(plot.bottomLeft(), plot.topLeft())
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for y, box, text in self.count_labels():
            p.drawLine(QPointF(plot.left() - 3, y), QPointF(plot.left(), y))
            p.drawText(box, right, text)
        for x, box, text in self.value_labels():
            p.drawLine(QPointF(x, plot.bottom()), QPointF(x, plot.bottom() + 3))
            p.drawText(box, Qt.AlignmentFlag.AlignCenter, text)
        p.end()


_VIRIDIS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def _ramp(stops: list[tuple[int, int, int]], t: float) -> QColor:
    t = min(1.0, max(0.0, t)) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    a, b = stops[i], stops[i + 1]
    return QColor(*(round(x + (y - x) * f) for x, y in zip(a, b, strict=True)))


def heat_colour(v: float, lo: float, hi: float) -> QColor:
    """Blue–white–red around 0 when the values straddle it, else a viridis ramp from lo to hi;
    grey for a bin without finite values."""
    if math.isnan(v):
        return QColor("#d1d5db")
    if lo < 0 < hi:
        top = max(-lo, hi)
        t = v / top
        return _ramp([(37, 99, 235), (255, 255, 255), (220, 38, 38)], (t + 1) / 2)
    return _ramp(_VIRIDIS, (v - lo) / (hi - lo) if hi > lo else 0.5)


class Heatmap(QWidget):
    """A slice's bin means as colours. ``clicked(row, col)``: the first cell of the bin clicked."""

    clicked = Signal(int, int)
    _MARGIN = 18.0

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.summary: SliceSummary | None = None
        self._image: QImage | None = None
        self._lo = self._hi = 0.0
        self.setMinimumSize(160, 110)  # a short window leaves the value table its rows
        self.setMouseTracking(True)

    def set_summary(self, summary: SliceSummary | None) -> None:
        self.summary = summary
        self._image = None
        if summary is not None and summary.heat:
            finite = [v for row in summary.heat for v in row if not math.isnan(v)]
            self._lo, self._hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
            rows, cols = len(summary.heat), len(summary.heat[0])
            image = QImage(cols, rows, QImage.Format.Format_RGB32)
            for i, row in enumerate(summary.heat):
                for j, v in enumerate(row):
                    image.setPixelColor(j, i, heat_colour(v, self._lo, self._hi))
            self._image = image
        self.setToolTip("")
        self.update()

    def _plot(self) -> QRectF:
        m = self._MARGIN
        return QRectF(m, m, max(1.0, self.width() - 2 * m), max(1.0, self.height() - 2 * m))

    def bin_at(self, x: float, y: float) -> tuple[int, int] | None:
        s, plot = self.summary, self._plot()
        if s is None or not s.heat or not plot.contains(QPointF(x, y)):
            return None
        i = min(len(s.heat) - 1, int((y - plot.top()) / plot.height() * len(s.heat)))
        j = min(len(s.heat[0]) - 1, int((x - plot.left()) / plot.width() * len(s.heat[0])))
        return i, j

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        hit = self.bin_at(event.position().x(), event.position().y())
        if hit is None or self.summary is None:
            self.setToolTip("")
            return
        i, j = hit
        s = self.summary
        self.setToolTip(
            f"rows {s.row_edges[i]}–{s.row_edges[i + 1] - 1}, columns {s.col_edges[j]}–{s.col_edges[j + 1] - 1}: "
            f"mean {s.heat[i][j]:.6g}"
        )

    def mousePressEvent(self, event: QMouseEvent) -> None:
        hit = self.bin_at(event.position().x(), event.position().y())
        if hit is not None and self.summary is not None:
            self.clicked.emit(self.summary.row_edges[hit[0]], self.summary.col_edges[hit[1]])

    def paintEvent(self, event: QPaintEvent) -> None:
        if self._image is None or self.summary is None:
            return
        p = QPainter(self)
        plot = self._plot()
        p.drawImage(plot, self._image)
        p.setPen(QPen(QColor("#6b7280")))
        p.drawRect(plot)
        s = self.summary
        small = QRectF(plot.left(), 0, plot.width(), self._MARGIN)
        p.drawText(small, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, "0")
        p.drawText(small, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, f"{s.col_edges[-1] - 1}")
        below = QRectF(plot.left(), plot.bottom(), plot.width(), self._MARGIN)
        p.drawText(
            below,
            Qt.AlignmentFlag.AlignCenter,
            f"rows 0–{s.row_edges[-1] - 1} ↓ · colour: mean {self._lo:.3g} … {self._hi:.3g}",
        )
        p.end()


class DrawButton(QPushButton):
    """Draws a slice's heatmap and histogram where they are not drawn by themselves: says what it
    reads, and why it waits to be asked."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Draw heatmap && histogram", parent)
        keep = self.sizePolicy()
        keep.setRetainSizeWhenHidden(True)  # its row does not jump when it shows
        self.setSizePolicy(keep)
        # as wide as its widest label, whatever it reads: the window's minimum never follows the text
        self._widest = super().sizeHint().width() + self.fontMetrics().horizontalAdvance(" (reads 1023.9 MiB)")

    def sizeHint(self) -> QSize:
        return QSize(self._widest, super().sizeHint().height())

    def minimumSizeHint(self) -> QSize:
        return self.sizeHint()

    def offer(self, size: int, auto: int, shown: bool) -> None:
        """``size``: the bytes drawing reads; ``auto``: the largest slice drawn unasked; ``shown``:
        whether the pictures are missing."""
        self.setText(f"Draw heatmap && histogram (reads {human_bytes(size)})")
        self.setToolTip(
            f"drawing the heatmap and histogram reads all {human_bytes(size)} of this slice (in strips: memory "
            f"stays bounded). Slices up to {human_bytes(auto)} are drawn as they are shown; a larger one "
            "when asked, as its read takes a while."
        )
        self.setVisible(shown)
