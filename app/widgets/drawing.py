"""Painted views: a tensor's chunk layout (boxes in its shape, byte ranges in its files) and a
histogram. Both are plain QWidgets fed with core data; they read nothing themselves."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from dcpstudio.core import Chunk

__all__ = ["ChunkDrawing", "Histogram"]

_PALETTE = ["#f97316", "#3b82f6", "#10b981", "#a855f7", "#ef4444", "#eab308", "#06b6d4", "#ec4899"]


class ChunkDrawing(QWidget):
    """Top: the tensor (first two dimensions) with each chunk as a box, coloured by file.
    Bottom: one bar per file with the byte ranges its chunks occupy."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.shape: tuple[int, ...] = ()
        self.chunks: list[Chunk] = []
        self.file_sizes: dict[str, int] = {}
        self.setMinimumHeight(240)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)

    def set_chunks(self, shape: tuple[int, ...], chunks: list[Chunk], root: Path | None) -> None:
        self.shape, self.chunks = shape, chunks
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
        files = sorted(self.file_sizes)
        return QColor(_PALETTE[files.index(file) % len(_PALETTE)] if file in files else "#9ca3af")

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
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.counts: list[int] = []
        self.edges: list[float] = []
        self.setMinimumHeight(110)

    def set_data(self, edges: list[float], counts: list[int]) -> None:
        self.edges, self.counts = edges, counts
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:
        if not self.counts:
            return
        p = QPainter(self)
        w, h = self.width(), self.height() - 18
        top = max(self.counts) or 1
        step = (w - 8) / len(self.counts)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(QColor("#3b82f6"))
        for i, c in enumerate(self.counts):
            bh = (h - 4) * c / top
            p.drawRect(QRectF(4 + i * step, h - bh, max(step - 1, 1), bh))
        p.setPen(QPen(QColor("#9ca3af")))
        p.drawText(QRectF(4, h + 2, w / 2, 16), Qt.AlignmentFlag.AlignLeft, f"{self.edges[0]:.4g}")
        p.drawText(QRectF(w / 2, h + 2, w / 2 - 4, 16), Qt.AlignmentFlag.AlignRight, f"{self.edges[-1]:.4g}")
        p.end()
