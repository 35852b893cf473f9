"""The Run view: a training run's checkpoints over their steps -- the step list, a plot of the
entry chosen in the tree (a tensor, or a module's combined series), the anomalies, a heat map of
every tensor at every step, the non-tensor values step by step (with a Hugging Face Trainer run's
trainer_state.json scalars: step, epoch, learning rate, loss), and the report's notes.

It shows a :class:`~dcpstudio.core.ops.drift.DriftReport` and reads nothing: the window's run
session (:mod:`..run_session`) computes the report as a job and says what to plot. What the user
asks for leaves as signals: ``step_chosen(position)`` (a row of the step list: the tree shows that
step, coloured by its change), ``compare_requested(a, b, name)`` (a point of the plot at step b
was clicked: compare the step before it with it, on that entry), ``entry_requested(name)`` (an
anomaly or a heat map cell was activated: its step is chosen too, and its entry is to be
selected). Positions are indexes into the run's steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core.checkpoints.model import printable, short_repr

from .run_heat import HeatMap
from .series_plot import SeriesPlot

__all__ = ["METRIC_TEXT", "RunView"]

METRIC_TEXT = {
    "rel_change": "relative change",
    "norm": "norm",
    "cos_prev": "cosine with the step before",
    "cos_first": "cosine with the first step",
    "max_abs_change": "max |change|",
    "nan": "NaN count",
    "inf": "Inf count",
    "p50": "median",
    "p99": "99th percentile",
    "max": "max",
}
"""The metrics of a drift report as the metric box names them, in its order."""


def _table(headers: tuple[str, ...]) -> QTableWidget:
    t = QTableWidget(0, len(headers))
    t.setHorizontalHeaderLabels(list(headers))
    t.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
    t.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
    t.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
    t.setTabKeyNavigation(False)
    t.verticalHeader().setVisible(False)
    t.verticalHeader().setDefaultSectionSize(22)
    header = t.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setStretchLastSection(True)
    return t


def _item(text: str, tip: str = "") -> QTableWidgetItem:
    item = QTableWidgetItem(printable(text))
    item.setToolTip(printable(tip or text))
    return item


class RunView(QWidget):
    step_chosen = Signal(int)
    compare_requested = Signal(int, int, str)
    entry_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.report: Any = None
        self.name: str | None = None  # the entry plotted
        self.position: int | None = None  # the chosen step
        self.title = QLabel("No run open: open a folder of checkpoints named by step (File › Open as Run…).")
        self.title.setTextFormat(Qt.TextFormat.PlainText)
        self.title.setWordWrap(True)
        self.status = QLabel()
        self.status.setObjectName("runStatus")
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.status.setWordWrap(True)
        self.legend = QLabel()  # what the tree's shading says (the run session fills it)
        self.legend.setObjectName("runLegend")
        self.legend.setTextFormat(Qt.TextFormat.PlainText)
        self.legend.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.cancel_button = QPushButton("Cancel")
        self.again_button = QPushButton("Analyse Again")
        self.again_button.setToolTip("Read the run's folder again (new steps) and recompute")
        self.steps = _table(("Step", "Checkpoint", "Anomalies"))
        self.steps.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # as wide as it needs
        self.steps.currentCellChanged.connect(lambda row, *_: self._step_row(row))
        self.metric_box = QComboBox()
        self.metric_box.setToolTip("What the plot shows of the entry selected in the tree")
        self.metric_box.currentIndexChanged.connect(lambda _: self.replot())
        self.log_box = QCheckBox("Log scale")
        self.log_box.toggled.connect(lambda _: self.replot())
        self.plot = SeriesPlot()
        self.plot.point_clicked.connect(self._point_clicked)
        self.hint = QLabel("Select a tensor or a group in the tree to plot it; click a point to compare its step.")
        self.hint.setObjectName("runHint")
        self.hint.setWordWrap(True)
        self.anomalies = _table(("Step", "Entry", "Kind", "Detail"))
        self.anomalies.cellActivated.connect(lambda row, _c: self._anomaly_row(row))
        self.anomalies.cellDoubleClicked.connect(lambda row, _c: self._anomaly_row(row))
        self.values = _table(("Value",))
        self.heat = HeatMap()
        self.heat.cell_clicked.connect(self._go)
        self.lists = QTabWidget()
        self.lists.addTab(self.anomalies, "Anomalies")
        self.lists.addTab(self.heat, "Heat Map")
        self.lists.addTab(self.values, "Values by Step")

        top = QHBoxLayout()
        top.addWidget(self.status, 1)
        top.addWidget(self.progress, 1)
        top.addWidget(self.cancel_button)
        top.addWidget(self.again_button)
        choose = QHBoxLayout()
        choose.addWidget(QLabel("Plot"))
        choose.addWidget(self.metric_box, 1)
        choose.addWidget(self.log_box)
        plot_side = QWidget()
        plot_lay = QVBoxLayout(plot_side)
        plot_lay.setContentsMargins(0, 0, 0, 0)
        plot_lay.addLayout(choose)
        plot_lay.addWidget(self.plot, 1)
        plot_lay.addWidget(self.hint)
        upper = QSplitter(Qt.Orientation.Horizontal)
        upper.setChildrenCollapsible(False)
        upper.addWidget(self.steps)
        upper.addWidget(plot_side)
        upper.setStretchFactor(1, 1)
        upper.setSizes([200, 460])
        split = QSplitter(Qt.Orientation.Vertical)
        split.setChildrenCollapsible(False)
        split.addWidget(upper)
        split.addWidget(self.lists)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        split.setSizes([340, 200])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.setSpacing(4)
        lay.addWidget(self.title)
        lay.addLayout(top)
        lay.addWidget(self.legend)
        lay.addWidget(split, 1)
        self.set_busy(False)

    # -- the run and its report -------------------------------------------------------------------
    def show_run(self, run: Any) -> None:
        """A run is being analysed: its steps listed, nothing plotted yet."""
        self.report, self.name, self.position = None, None, None
        self.title.setText(f"Run: {printable(str(run.location))} — {len(run.steps)} steps ({run.convention})")
        self._fill_steps([s.step for s in run.steps], [s.name for s in run.steps], {})
        self.anomalies.setRowCount(0)
        self.values.setRowCount(0)
        self.heat.show_cells([], [], np.zeros((0, 0, 4), dtype=np.uint8), np.zeros((0, 0)))
        self.legend.setText("")
        self.metric_box.clear()
        self.plot.clear()
        skipped = "; ".join(f"{n}: {why}" for n, why in getattr(run, "skipped", ()))
        self.say(f"Reading {len(run.steps)} checkpoints…" + (f" Not steps yet: {skipped}" if skipped else ""))

    def show_report(self, report: Any, names: list[str], cells: Any = None) -> None:
        """``report``'s steps, anomalies and values; ``names``: the steps' checkpoint names;
        ``cells``: the heat map's (:func:`~.run_heat.heat_rgba` of the tensors' relative changes)."""
        self.report = report
        if cells is not None:
            self.heat.show_cells(list(report.series), report.steps, cells[0], cells[1])
            scale = cells[2]
            self.lists.setTabToolTip(
                1,
                "Every tensor at every step, by its relative change"
                + (f": {scale.legend()}; white: no value" if scale is not None else ""),
            )
        counts: dict[int, int] = {}
        for a in report.anomalies:
            counts[a.step] = counts.get(a.step, 0) + 1
        self._fill_steps(report.steps, names, counts)
        self.anomalies.setRowCount(len(report.anomalies))
        for row, a in enumerate(report.anomalies):
            detail = a.detail + (f" [{a.chunk}]" if a.chunk else "")
            for col, text in enumerate((str(a.step), a.entry, a.kind, detail)):
                self.anomalies.setItem(row, col, _item(text))
        self.lists.setTabText(0, f"Anomalies ({len(report.anomalies)})")
        self._fill_values(report)
        metrics = list(dict.fromkeys(m for ms in (*report.series.values(), *report.groups.values()) for m in ms))
        ordered = [m for m in METRIC_TEXT if m in metrics] + [m for m in metrics if m not in METRIC_TEXT]
        self.metric_box.blockSignals(True)
        self.metric_box.clear()
        for m in ordered:
            self.metric_box.addItem(METRIC_TEXT.get(m) or m, m)
        self.metric_box.blockSignals(False)
        n = len(report.anomalies)
        notes = list(getattr(report, "notes", ()))
        self.say(
            f"{len(report.steps)} steps ({report.steps[0]}–{report.steps[-1]}), {len(report.series):,} tensors, "
            f"{n} anomal{'y' if n == 1 else 'ies'}" + "".join(f"\nNote: {printable(note)}" for note in notes)
        )

    def _fill_steps(self, steps: list[int], names: list[str], counts: dict[int, int]) -> None:
        self.steps.blockSignals(True)
        self.steps.setRowCount(len(steps))
        for row, (step, name) in enumerate(zip(steps, names, strict=True)):
            self.steps.setItem(row, 0, _item(str(step)))
            self.steps.setItem(row, 1, _item(name))
            self.steps.setItem(row, 2, _item(str(counts[step]) if counts.get(step) else ""))
        self.steps.blockSignals(False)
        self.steps.resizeColumnsToContents()
        frame = 2 * self.steps.frameWidth() + self.steps.verticalScrollBar().sizeHint().width()
        self.steps.setMinimumWidth(min(self.steps.horizontalHeader().length() + frame, 320))  # never cut

    def _fill_values(self, report: Any) -> None:
        """One row per non-tensor value, one column per step (a Hugging Face Trainer run's
        ``trainer_state.*`` from each step's trainer_state.json among them)."""
        names = sorted(report.values)
        self.values.setColumnCount(1 + len(report.steps))
        self.values.setHorizontalHeaderLabels(["Value", *(f"step {s}" for s in report.steps)])
        self.values.setRowCount(len(names))
        for row, name in enumerate(names):
            logged = name.startswith("trainer_state.") and name not in (
                "trainer_state.global_step",
                "trainer_state.epoch",
            )
            tip = f"{name}: from the step's trainer_state.json" + (
                ", the last value logged at or before the step" if logged else ""
            )
            self.values.setItem(row, 0, _item(name, tip if name.startswith("trainer_state.") else ""))
            for col, v in enumerate(report.values[name], 1):
                self.values.setItem(row, col, _item("" if v is None else short_repr(v, 80), short_repr(v, 400)))
        self.lists.setTabText(2, f"Values by Step ({len(names)})")

    def say(self, text: str, state: str = "") -> None:
        self.status.setText(text)
        self.status.setProperty("state", state)
        self.status.style().unpolish(self.status)
        self.status.style().polish(self.status)

    def set_busy(self, busy: bool) -> None:
        self.cancel_button.setVisible(busy)
        self.again_button.setEnabled(not busy)
        self.progress.setVisible(busy)
        if busy:
            self.progress.setValue(0)

    # -- the step and the entry shown ---------------------------------------------------------------
    def current_metric(self) -> str:
        return str(self.metric_box.currentData() or "rel_change")

    def series_of(self, name: str) -> dict[str, list[Any]] | None:
        """``name``'s series: a tensor's, or a module's (a group of the tree)."""
        if self.report is None:
            return None
        got: dict[str, list[Any]] | None = self.report.series.get(name) or self.report.groups.get(name)
        return got

    def plot_entry(self, name: str | None) -> bool:
        """Plot ``name`` (a tensor or a module of the report); False when the report has no such series."""
        self.name = name
        return self.replot()

    def replot(self) -> bool:
        series = self.series_of(self.name) if self.name is not None else None
        metric = self.current_metric()
        if series is None or metric not in series:
            self.plot.clear()
            if self.report is not None:
                self.hint.setText(
                    f"{printable(self.name)} has no {METRIC_TEXT.get(metric, metric)} in this run."
                    if self.name
                    else "Select a tensor or a group in the tree to plot it; click a point to compare its step."
                )
            return False
        report = self.report
        steps = report.steps
        ringed = [steps.index(a.step) for a in report.anomalies if a.entry == self.name and a.step in steps]
        self.plot.show_series(
            report.steps, series[metric], METRIC_TEXT.get(metric, metric), title=self.name or "", anomalies=ringed,
            log=self.log_box.isChecked(),
        )  # fmt: skip
        self.plot.mark_step(self.position)
        group = self.name not in report.series
        self.hint.setText(
            ("A module: its tensors together. " if group else "")
            + "Click a point to compare its step with the one before, on this entry."
        )
        return True

    def choose_step(self, position: int) -> None:
        """Mark the step at ``position`` (in the list and on the plot) without asking for anything."""
        self.position = position
        self.steps.blockSignals(True)
        self.steps.selectRow(position)
        self.steps.blockSignals(False)
        self.plot.mark_step(position)

    def _step_row(self, row: int) -> None:
        if 0 <= row < self.steps.rowCount():
            self.choose_step(row)
            self.step_chosen.emit(row)

    def _point_clicked(self, position: int) -> None:
        if self.name is None:
            return
        if position == 0:
            self.say("The first step has no step before it to compare with.")
            return
        self.compare_requested.emit(position - 1, position, self.name)

    def _anomaly_row(self, row: int) -> None:
        if self.report is not None and 0 <= row < len(self.report.anomalies):
            a = self.report.anomalies[row]
            if a.step in self.report.steps:
                self._go(a.entry, self.report.steps.index(a.step))

    def _go(self, name: str, position: int) -> None:
        """Show the step at ``position`` with ``name`` selected (an anomaly, a heat map cell)."""
        self.name = name  # what the step about to be shown selects
        self.choose_step(position)
        self.step_chosen.emit(position)
        self.entry_requested.emit(name)
