""" "Load on N ranks": spawn local ranks that load the open checkpoint into a sharded layout and
check every shard; one progress bar per rank and the per-rank result table. The status line follows
the ranks; a failure is shown here, the bars stopped where they were, marked failed. Opening another
checkpoint clears what was about the last one."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core.ops.report import human_bytes, plural
from dcpstudio.core.ranks.load import LAYOUTS, run_load

from ..context import Context
from ..locations import is_remote, location, shown
from ..notify import describe
from ..workers import Job
from .ranks_choice import rank_bars

__all__ = ["LoadPanel"]


class LoadPanel(QGroupBox):
    def __init__(self, ctx: Context, parent: QWidget | None = None) -> None:
        super().__init__("Load on N ranks", parent)
        self.ctx = ctx
        self.ranks = QSpinBox()
        self.ranks.setRange(1, 64)
        self.ranks.setValue(2)
        self.layout_box = QComboBox()
        self.layout_box.addItems(list(LAYOUTS))
        self.layout_box.setCurrentText("shard0")
        self.mesh = QLineEdit()
        self.mesh.setPlaceholderText("mesh, e.g. 2x2 (empty: 1-D)")
        form = QFormLayout()
        form.addRow("Ranks", self.ranks)
        form.addRow("Layout", self.layout_box)
        form.addRow("Mesh", self.mesh)
        self.load_button = QPushButton("Load and check")
        self.load_button.clicked.connect(self.load)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(lambda: self.ctx.board.cancel("load"))
        buttons = QHBoxLayout()
        buttons.addWidget(self.load_button)
        buttons.addWidget(self.cancel_button)
        self.bars_box = QVBoxLayout()
        self.bars: list[QProgressBar] = []
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.table = QTableWidget(0, 8)
        self.table.setHorizontalHeaderLabels(
            ["rank", "start-up", "load time", "received", "sent", "local shards", "peak RSS", "check"]
        )
        start_up = self.table.horizontalHeaderItem(1)
        assert start_up is not None
        start_up.setToolTip(
            "From the Load click until the rank had joined the process group: start, imports, rendezvous"
        )
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setTabKeyNavigation(False)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addLayout(buttons)
        lay.addLayout(self.bars_box)
        lay.addWidget(self.status)
        lay.addWidget(self.table)
        self._clear_bars()
        self.set_busy(False)

    def load(self) -> Job | None:
        """Spawn the ranks on the open checkpoint (a job: the window stays responsive)."""
        ckpt = self.ctx.checkpoint()
        if ckpt is None:
            self.ctx.notifier.info("Open a checkpoint first.")
            return None
        path = location(ckpt.path)  # a URL whole (query included): the ranks open it themselves
        if is_remote(path) and str(path).lower().startswith("memory://"):
            self.ctx.notifier.info(
                f"{shown(path)} lives in this process's memory: ranks are separate processes and cannot read it."
            )
            return None
        ranks = self.ranks.value()
        layout = self.layout_box.currentText()
        mesh = self.mesh.text().strip() or None
        self.start(ranks)

        def work(progress: Any, cancel: Any) -> list[Any]:
            return run_load(path, ranks=ranks, layout=layout, mesh=mesh, on_progress=progress, cancel=cancel)

        job = self.ctx.start("load", work, self.show_reports, lambda: self.set_busy(False), self.rank_progress)
        job.cancelled.connect(lambda: self._stopped(ckpt, "Cancelled; the ranks were stopped.", "cancelled"))
        job.errored.connect(lambda e: self._stopped(ckpt, f"Failed: {describe(e)}", "failed"))
        return job

    def _stopped(self, ckpt: Any, text: str, how: str) -> None:
        if ckpt is not self.ctx.checkpoint():
            return  # stopped because its checkpoint was closed: the panel is about another one now
        self.status.setText(text)
        for r, bar in enumerate(self.bars):
            stage = self._stages.get(r, "")
            bar.setFormat(f"rank {r}: {how}" + (f" after {stage}" if stage else "") + " %p%")
            bar.setProperty("failed", how == "failed")
            bar.style().unpolish(bar)
            bar.style().polish(bar)

    def checkpoint_changed(self) -> None:
        """The results shown are about the checkpoint just closed: gone, with its running load."""
        self.ctx.board.cancel("load")
        self._clear_bars()
        self.table.setRowCount(0)
        self.status.setText("")

    def _clear_bars(self) -> None:
        self.bars = rank_bars(self.bars_box, self.bars, 0)
        self._stages: dict[int, str] = {}
        self._fractions: dict[int, float] = {}

    def start(self, ranks: int) -> None:
        self._clear_bars()
        self.bars = rank_bars(self.bars_box, self.bars, ranks)
        self.table.setRowCount(0)
        self.status.setText(f"Starting {ranks} ranks…")
        self.set_busy(True)

    def set_busy(self, busy: bool) -> None:
        self.load_button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)

    def rank_progress(self, p: Any) -> None:
        if 0 <= p.rank < len(self.bars):
            self.bars[p.rank].setValue(int(p.fraction * 100))
            self.bars[p.rank].setFormat(f"rank {p.rank}: {p.stage} %p%")
            self._stages[p.rank], self._fractions[p.rank] = p.stage, p.fraction
            stages = ", ".join(dict.fromkeys(self._stages[r] for r in sorted(self._stages)))
            lo, hi = (round(f(self._fractions.values()) * 100) for f in (min, max))
            waiting = len(self.bars) - len(self._stages)
            self.status.setText(
                f"{len(self.bars)} ranks at {lo} %"
                + (f"–{hi} %" if hi != lo else "")
                + f": {stages}"
                + (f" ({waiting} not started yet)" if waiting else "")
            )

    def show_reports(self, reports: list[Any]) -> None:
        self.table.setRowCount(len(reports))
        for row, r in enumerate(reports):
            check = f"ok ({plural(r.checked, 'entry')})" if r.ok else "MISMATCH: " + ", ".join(r.mismatches[:3])
            cells = [
                r.rank,
                f"{r.startup:.2f} s",
                f"{r.seconds:.2f} s",
                human_bytes(r.bytes_received),
                human_bytes(r.bytes_sent),
                human_bytes(r.local_bytes),
                human_bytes(r.peak_rss),
                check,
            ]
            for col, value in enumerate(cells):
                self.table.setItem(row, col, QTableWidgetItem(str(value)))
        ok = all(r.ok for r in reports)
        self.status.setText("Every shard matches the source." if ok else "Some shards differ from the source.")
