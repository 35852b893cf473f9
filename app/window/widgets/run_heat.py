"""A run at a glance: every tensor (a row) at every step (a column), coloured by its relative change
there, drawn with pyqtgraph (imported with the Run view).

The colours are the tree's (:mod:`..heat`): pale for the run's smallest change, red for its
largest, blue-grey where a tensor did not change, white where it has no value (the first step, or
a step that lacks the tensor). Under the pointer, the cell's tensor, step and value;
``cell_clicked(name, position)`` when a cell is clicked (``position``: of its step in the run).
The cells are coloured by :func:`heat_rgba` -- on the worker that computed the report, as a large
run has millions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtWidgets import QVBoxLayout, QWidget

from ..heat import FROZEN, NONFINITE, Scale
from .series_plot import value_text

__all__ = ["HeatMap", "heat_rgba"]

_MISSING = (255, 255, 255, 255)


def _on_white(rgba: Any) -> np.ndarray:
    """Translucent colours (the tree's, over a white row) as the opaque colours they look like."""
    c = np.asarray(rgba, dtype=np.float64).reshape(-1, 4)
    a = c[:, 3:4] / 255.0
    out = np.concatenate([c[:, :3] * a + 255.0 * (1 - a), np.full((len(c), 1), 255.0)], axis=1)
    return np.rint(out).astype(np.uint8)


def heat_rgba(values: list[list[Any]]) -> tuple[np.ndarray, np.ndarray, Scale | None]:
    """The colours (rows × steps × RGBA, uint8) of ``values`` (a row of changes per tensor, None
    where there is none), the changes as float64 (NaN where there is none), and the scale."""
    m = np.array([[math.nan if v is None else float(v) for v in row] for row in values], dtype=np.float64)
    m = m.reshape(len(values), -1)
    rgba = np.empty((*m.shape, 4), dtype=np.uint8)
    rgba[:] = _MISSING
    positive = np.isfinite(m) & (m > 0)
    scale = Scale(float(m[positive].min()), float(m[positive].max())) if positive.any() else None
    if scale is not None:
        lo, hi = math.log10(scale.lo), math.log10(scale.hi)
        t = np.zeros(m.shape) if hi <= lo else (np.log10(np.where(positive, m, 1.0)) - lo) / (hi - lo)
        table = _on_white([scale.colour(10 ** (lo + s * (hi - lo))).getRgb() for s in np.linspace(0, 1, 65)])
        rgba[positive] = table[np.rint(np.clip(t, 0.0, 1.0) * 64).astype(np.intp)[positive]]
    rgba[m == 0] = _on_white(FROZEN.getRgb())[0]
    rgba[np.isinf(m)] = _on_white(NONFINITE.getRgb())[0]
    return rgba, m, scale


class HeatMap(QWidget):
    cell_clicked = Signal(str, int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        import pyqtgraph as pg  # with the Run view only: see series_plot

        self.names: list[str] = []
        self.steps: list[int] = []
        self.changes = np.zeros((0, 0))
        self.widget = pg.PlotWidget(background="w")
        self.widget.setMinimumHeight(60)
        item = self.widget.getPlotItem()
        item.setMenuEnabled(False)
        item.hideButtons()
        item.invertY(True)  # the first tensor at the top, as in the tree
        item.setLabel("bottom", "step")
        item.setLabel("left", "tensors (hover for names)")
        item.getAxis("left").setStyle(showValues=False)
        for side in ("left", "bottom"):
            item.getAxis(side).setTextPen(pg.mkPen("#111827"))
        self.image = pg.ImageItem(axisOrder="row-major")
        item.addItem(self.image)
        self.hover = pg.TextItem(color="#111827", fill=pg.mkBrush(255, 255, 255, 235), border=pg.mkPen("#9ca3af"))
        self.hover.setZValue(10)
        self.hover.hide()
        item.addItem(self.hover, ignoreBounds=True)
        self.widget.scene().sigMouseMoved.connect(self._moved)
        self.widget.scene().sigMouseClicked.connect(self._clicked)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.widget)

    def show_cells(self, names: list[str], steps: list[int], rgba: np.ndarray, changes: np.ndarray) -> None:
        """Show ``rgba`` (from :func:`heat_rgba`): row i is ``names[i]``, column j step ``steps[j]``."""
        self.names, self.steps, self.changes = names, steps, changes
        self.image.setImage(rgba, autoLevels=False)
        if names and steps:
            # column j spans steps[j] ± half a step, so the step axis reads the run's step numbers
            first, last = steps[0], steps[-1]
            width = (last - first) / max(len(steps) - 1, 1) or 1.0
            self.image.setRect(QRectF(first - width / 2, 0, width * len(steps), len(names)))
        self.widget.getPlotItem().enableAutoRange()
        self.hover.hide()

    def cell_at(self, scene_pos: QPointF) -> tuple[int, int] | None:
        """(row, column) of the cell under ``scene_pos``, or None."""
        if not self.names or not self.steps:
            return None
        p = self.image.mapFromScene(scene_pos)
        row, col = math.floor(p.y()), math.floor(p.x())
        return (row, col) if 0 <= row < len(self.names) and 0 <= col < len(self.steps) else None

    def cell_point(self, row: int, col: int) -> QPointF:
        """The centre of a cell in the plot widget's coordinates (tests click there)."""
        scene = self.image.mapToScene(QPointF(col + 0.5, row + 0.5))
        return QPointF(self.widget.mapFromScene(scene))

    def _moved(self, pos: QPointF) -> None:
        cell = self.cell_at(pos)
        if cell is None:
            self.hover.hide()
            return
        row, col = cell
        v = self.changes[row, col]
        text = "no value" if math.isnan(v) else ("unchanged" if v == 0 else value_text(float(v)))
        self.hover.setText(f"{self.names[row]}\nstep {self.steps[col]}: relative change {text}")
        view = self.widget.getPlotItem().vb.mapSceneToView(pos)
        self.hover.setPos(view)
        right = col > len(self.steps) / 2
        self.hover.setAnchor((1.05, 1.05) if right else (-0.05, 1.05))
        self.hover.show()

    def hover_text(self) -> str:
        return str(self.hover.textItem.toPlainText()) if self.hover.isVisible() else ""

    def _clicked(self, event: Any) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return
        cell = self.cell_at(event.scenePos())
        if cell is not None:
            self.cell_clicked.emit(self.names[cell[0]], cell[1])
