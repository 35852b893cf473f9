"""Convert › Check: is the open checkpoint whole? :func:`~dcpstudio.core.ops.integrity.check` runs
as a job (progress, Cancel; the GUI thread only shows what it found), and its findings fill a
table in a window of its own -- the summary line first ("whole: …" when there are none), then one
row per finding: file, entry, what is wrong. The entries named are marked in the tree, with the
groups above them, so a damaged tensor is seen where it is browsed; another checkpoint's tree
starts unmarked. A double-click on a row selects its entry in the tree.

A result that arrives for a checkpoint no longer shown is dropped: opening another one cancels the
check ("check" is cancelled with the jobs that read the open checkpoint)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import Checkpoint
from dcpstudio.core.checkpoints.model import printable
from dcpstudio.core.ops.integrity import CheckReport, check

from ..context import Context
from ..locations import name_of
from ..notify import describe
from ..workers import Job
from .tree_pane import TreePane

__all__ = ["CheckView", "check_open"]

_COLUMNS = ("File", "Entry", "Finding")


class CheckView(QDialog):
    """The Check window; :meth:`run` checks the open checkpoint (the Convert menu's Check)."""

    def __init__(self, ctx: Context, tree_pane: TreePane, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.tree_pane = tree_pane
        self.report: CheckReport | None = None
        self.setWindowTitle("Check")
        self.summary = QLabel()
        self.summary.setObjectName("checkSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.table = QTableWidget(0, len(_COLUMNS))
        self.table.setHorizontalHeaderLabels(list(_COLUMNS))
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.cellDoubleClicked.connect(self._select_entry)
        self.values = QCheckBox("Also read every tensor (NaN, Inf, all-zero)")
        self.values.setToolTip("Reads all tensor data once: as long as reading the checkpoint")
        self.again_button = QPushButton("Check Again")
        self.again_button.clicked.connect(lambda: self.run())
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(lambda: self.ctx.board.cancel("check"))
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        buttons = QHBoxLayout()
        buttons.addWidget(self.values, 1)
        for b in (self.again_button, self.cancel_button, close):
            buttons.addWidget(b)
        lay = QVBoxLayout(self)
        lay.addWidget(self.summary)
        lay.addWidget(self.progress)
        lay.addWidget(self.table, 1)
        lay.addLayout(buttons)
        self.resize(760, 420)

    def run(self) -> Job | None:
        """Check the open checkpoint on a worker (one check at a time: a new one cancels the old)."""
        ckpt = self.ctx.checkpoint()
        if ckpt is None:
            self.ctx.notifier.info("Open a checkpoint first, then check it.")
            return None
        values = self.values.isChecked()
        self.report = None
        self.table.setRowCount(0)
        self.progress.setValue(0)
        self._say(f"Checking {printable(name_of(ckpt.path))}…", "")
        self.cancel_button.setEnabled(True)
        self.show()
        self.raise_()

        def work(progress: Any, cancel: Any) -> CheckReport:
            return check(ckpt, values=values, progress=progress, cancel=cancel)

        job = self.ctx.start("check", work, lambda r: self.show_report(ckpt, r), on_progress=self._advance)

        def ended(say: str, state: str) -> None:  # a replaced check's end says nothing of the one running
            if self.ctx.board.jobs.get("check") is job:
                self.cancel_button.setEnabled(False)
                if say:
                    self._say(say, state)

        job.errored.connect(lambda e: ended(f"Not checked: {describe(e)}", "error"))
        job.cancelled.connect(lambda: ended("Cancelled: nothing was marked.", ""))
        job.finished.connect(lambda: ended("", ""))
        return job

    def _advance(self, p: Any) -> None:
        if hasattr(p, "fraction"):
            self.progress.setValue(int(p.fraction * 1000))
            if p.current:
                self.progress.setFormat(f"%p%  {printable(p.current)}")

    def show_report(self, ckpt: Checkpoint, report: CheckReport) -> None:
        """Fill the table with ``report`` and mark its entries in the tree (if ``ckpt`` is still
        the one shown)."""
        if self.ctx.checkpoint() is not ckpt:
            return
        self.report = report
        self.progress.setValue(1000)
        self.progress.setFormat("%p%")
        self._say(report.summary(), "ok" if report.whole else "error")
        self.table.setRowCount(len(report.findings))
        for row, f in enumerate(report.findings):
            for col, text in enumerate((f.file, f.entry, f.what)):
                item = QTableWidgetItem(printable(text))
                item.setToolTip(printable(text))
                self.table.setItem(row, col, item)
        marks: dict[str, str] = {}
        for f in report.findings:
            if f.entry:
                marks[f.entry] = f"{marks[f.entry]}; {f.what}" if f.entry in marks else f.what
        if self.tree_pane.model is not None:
            self.tree_pane.model.mark(marks)

    def _say(self, text: str, state: str) -> None:
        self.summary.setText(text)
        self.summary.setProperty("state", state)
        self.summary.style().unpolish(self.summary)
        self.summary.style().polish(self.summary)

    def _select_entry(self, row: int, _col: int) -> None:
        if self.report is not None and 0 <= row < len(self.report.findings) and self.report.findings[row].entry:
            self.tree_pane.select(self.report.findings[row].entry)


def check_open(window: Any) -> Job | None:
    """Convert › Check on ``window`` (the main window): its Check window is made when first used,
    so the window starts without it, and kept as ``window.check_view``."""
    view: CheckView | None = getattr(window, "check_view", None)
    if view is None:
        view = window.check_view = CheckView(window.ctx, window.tree_pane, window)
    return view.run()
