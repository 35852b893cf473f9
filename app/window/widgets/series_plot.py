"""A line plot of one series over a run's steps, drawn with pyqtgraph.

pyqtgraph costs ~0.35 s to import, so this module imports it inside :class:`SeriesPlot`, which the
Run view makes when a run is first shown: the window paints without it. The plot shows one point
per step whose value is finite (a step without one -- the first step's change, a tensor missing
there -- leaves a gap in the line), a dashed marker at the chosen step, red rings on the steps an
anomaly names, and, under the pointer, the nearest step's value. Clicking a point emits
``point_clicked(position)``: the position of its step in the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtWidgets import QVBoxLayout, QWidget

__all__ = ["SeriesPlot", "finite_points", "value_text"]

_LINE = "#2563eb"
_MARK = "#f97316"
_ANOMALY = "#dc2626"


def value_text(value: float) -> str:
    """A value as the hover shows it: four significant digits, ``1.234e-05`` when small."""
    return f"{value:.4g}"


def finite_points(xs: Sequence[float], ys: Sequence[float | None]) -> tuple[list[float], list[float], list[int]]:
    """The points of ``ys`` that can be drawn (finite values), with their positions in the run."""
    keep = [i for i, y in enumerate(ys) if y is not None and math.isfinite(y)]
    return [float(xs[i]) for i in keep], [float(ys[i]) for i in keep], keep  # type: ignore[arg-type]


class SeriesPlot(QWidget):
    """``point_clicked(position)``: a point was clicked (the position of its step in the run)."""

    point_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        import pyqtgraph as pg  # here, not at module level: see the module's docstring

        self._pg = pg
        self.steps: list[int] = []
        self.values: list[float | None] = []
        self.metric_name = ""
        self.log = False
        self._drawn: tuple[list[float], list[float], list[int]] = ([], [], [])
        self.widget = pg.PlotWidget(background="w")
        self.widget.setMinimumHeight(80)  # the Run view must not raise the window's minimum
        item = self.widget.getPlotItem()
        item.showGrid(x=True, y=True, alpha=0.25)
        item.setMenuEnabled(False)  # its context menu offers exports and transforms we do not support
        item.hideButtons()
        for side in ("left", "bottom"):
            axis = item.getAxis(side)
            axis.setPen(pg.mkPen("#6b7280"))
            axis.setTextPen(pg.mkPen("#111827"))
            axis.enableAutoSIPrefix(False)  # "0.002", not "2" under a "(x0.001)" label
        item.setLabel("bottom", "step")
        self.line = pg.PlotDataItem([], [], pen=pg.mkPen(_LINE, width=2), connect="finite")
        # PlotDataItems, not bare ScatterPlotItems: only they follow the value axis into log mode
        self.points = pg.PlotDataItem([], [], pen=None, symbol="o", symbolSize=8, symbolBrush=_LINE, symbolPen="w")
        self.rings = pg.PlotDataItem(
            [], [], pen=None, symbol="o", symbolSize=16, symbolBrush=None, symbolPen=pg.mkPen(_ANOMALY, width=2)
        )
        dashed = pg.mkPen(_MARK, width=1.5, style=Qt.PenStyle.DashLine)
        self.marker = pg.InfiniteLine(angle=90, movable=False, pen=dashed)
        self.hover = pg.TextItem(color="#111827", fill=pg.mkBrush(255, 255, 255, 230), border=pg.mkPen("#9ca3af"))
        self.hover.setZValue(10)
        self.hover.hide()
        for part in (self.line, self.rings, self.points, self.marker, self.hover):
            item.addItem(part)
        self.marker.hide()
        self.points.sigPointsClicked.connect(self._clicked)
        self.widget.scene().sigMouseMoved.connect(self._moved)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.widget)

    # -- data -------------------------------------------------------------------------------------
    def show_series(
        self,
        steps: Sequence[int],
        values: Sequence[float | None],
        metric: str,
        *,
        title: str = "",
        anomalies: Sequence[int] = (),
        log: bool = False,
    ) -> None:
        """Plot ``values`` (one per step, None where there is none) against ``steps``; ring the
        steps at the positions ``anomalies``; ``log``: a logarithmic value axis (points ≤ 0 left out)."""
        self.steps, self.values, self.metric_name = list(steps), list(values), metric
        shown = [None if v is None or (log and v <= 0) else v for v in self.values]
        xs, ys, where = self._drawn = finite_points(self.steps, shown)
        item = self.widget.getPlotItem()
        self.log = log
        item.setLogMode(y=log)
        line_y = [math.nan if v is None or not math.isfinite(v) else v for v in shown]
        self.line.setData([float(s) for s in self.steps], line_y)
        self.points.setData(xs, ys, data=where)
        ringed = [i for i in anomalies if i in where]
        self.rings.setData([float(self.steps[i]) for i in ringed], [ys[where.index(i)] for i in ringed])
        item.setLabel("left", metric)
        item.setTitle(title, color="#111827", size="10pt")
        self.hover.hide()
        item.enableAutoRange()

    def clear(self) -> None:
        self.show_series([], [], "")
        self.marker.hide()

    def plotted(self) -> tuple[list[float], list[float]]:
        """The points drawn (x: steps, y: values), as the plot holds them."""
        xs, ys = self.points.xData, self.points.yData
        return ([float(x) for x in xs], [float(y) for y in ys]) if xs is not None else ([], [])

    def mark_step(self, position: int | None) -> None:
        """The dashed marker at the step at ``position`` (None: no marker)."""
        if position is None or not 0 <= position < len(self.steps):
            self.marker.hide()
            return
        self.marker.setValue(self.steps[position])
        self.marker.show()

    def scene_point(self, position: int) -> QPointF | None:
        """Where the point of the step at ``position`` is, in the plot widget's coordinates (None
        when it has no point); tests click there."""
        xs, ys, where = self._drawn
        if position not in where:
            return None
        k = where.index(position)
        y = math.log10(ys[k]) if self.log else ys[k]
        scene = self.widget.getPlotItem().vb.mapViewToScene(QPointF(xs[k], y))
        return QPointF(self.widget.mapFromScene(scene))

    # -- interaction ------------------------------------------------------------------------------
    def _clicked(self, _item: Any, points: Any, *_: Any) -> None:
        if len(points):
            self.point_clicked.emit(int(points[0].data()))

    def _moved(self, pos: QPointF) -> None:
        """The value of the step nearest the pointer, beside its point."""
        vb = self.widget.getPlotItem().vb
        xs, ys, where = self._drawn
        if not xs or not vb.sceneBoundingRect().contains(pos):
            self.hover.hide()
            return
        x = vb.mapSceneToView(pos).x()
        k = min(range(len(xs)), key=lambda j: abs(xs[j] - x))
        y = math.log10(ys[k]) if self.log else ys[k]
        self.hover.setText(f"step {self.steps[where[k]]}\n{self.metric_name} {value_text(ys[k])}")
        self.hover.setPos(xs[k], y)
        (x0, x1), (y0, y1) = vb.viewRange()
        left = xs[k] > (x0 + x1) / 2  # the label goes toward the middle of the plot, never off its edge
        below = y > (y0 + y1) / 2
        self.hover.setAnchor((1.08 if left else -0.08, -0.15 if below else 1.15))
        self.hover.show()

    def hover_text(self) -> str:
        return str(self.hover.textItem.toPlainText()) if self.hover.isVisible() else ""
