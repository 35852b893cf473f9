"""File › Open as Run…: the run's folder and, for checkpoints named in no usual way, a regular
expression for their names (its group ``step``, or its first group, is the step). OK once the
folder is named and the pattern, if any, is a regular expression with a group."""

from __future__ import annotations

import re

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

__all__ = ["OpenRunDialog", "pattern_problem"]

_USUAL = "step-100, checkpoint-500, epoch=3-step=1200.ckpt, iter_0001000, global_step300, 1000, step_1000.pt"


def pattern_problem(pattern: str) -> str:
    """Why ``pattern`` cannot name a run's checkpoints ("" when it can, or is empty)."""
    if not pattern:
        return ""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        return f"not a regular expression: {e}"
    return "" if "step" in rx.groupindex or rx.groups else "no group for the step: use (?P<step>\\d+) or (\\d+)"


class OpenRunDialog(QDialog):
    def __init__(self, folder: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Open as Run")
        self.folder = QLineEdit(folder)
        self.folder.setMinimumWidth(self.folder.fontMetrics().horizontalAdvance("x" * 48))
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.pattern = QLineEdit()
        self.pattern.setPlaceholderText("empty: the usual names")
        self.pattern.setToolTip("A regular expression matching a whole checkpoint name, e.g. ckpt_(?P<step>\\d+)\\.pt")
        self.problem = QLabel()
        self.problem.setObjectName("planSummary")
        self.problem.setProperty("state", "error")
        hint = QLabel(f"A folder of checkpoints named by step: {_USUAL}; or name them with a pattern.")
        hint.setWordWrap(True)
        hint.setObjectName("hint")
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        row = QHBoxLayout()
        row.addWidget(self.folder, 1)
        row.addWidget(browse)
        form = QFormLayout()
        form.addRow("Folder", row)
        form.addRow("Names", self.pattern)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.problem)
        lay.addWidget(hint)
        lay.addWidget(self.buttons)
        self.folder.textChanged.connect(self._check)
        self.pattern.textChanged.connect(self._check)
        self._check()

    def _browse(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "The run's folder", self.folder.text())
        if path:
            self.folder.setText(path)

    def choice(self) -> tuple[str, str | None]:
        """(folder, pattern or None)."""
        return self.folder.text().strip(), self.pattern.text().strip() or None

    def _check(self) -> None:
        problem = pattern_problem(self.pattern.text().strip())
        self.problem.setText(problem)
        self.problem.setVisible(bool(problem))
        ok = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        if ok is not None:
            ok.setEnabled(bool(self.folder.text().strip()) and not problem)

    def accept(self) -> None:
        if self.folder.text().strip() and not pattern_problem(self.pattern.text().strip()):
            super().accept()
