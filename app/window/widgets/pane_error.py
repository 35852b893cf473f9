"""A read that failed, said where it was asked for: the message (selectable) and a Retry button.

A pane whose job failed shows this in place of its "reading…" text, so nothing waits forever;
Retry runs the pane's read again (a file put back, a store reachable again).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

__all__ = ["PaneError"]


class PaneError(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.label = QLabel()
        self.label.setObjectName("paneError")
        self.label.setTextFormat(Qt.TextFormat.PlainText)  # messages quote names from files: never markup
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.retry_button = QPushButton("Retry")
        self.retry_button.clicked.connect(self._retry)
        self._again: Callable[[], object] | None = None
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.retry_button, 0, Qt.AlignmentFlag.AlignTop)
        self.clear()

    def show_error(self, text: str, retry: Callable[[], object] | None) -> None:
        self.label.setText(text)
        self._again = retry
        self.retry_button.setVisible(retry is not None)
        self.show()

    def clear(self) -> None:
        self.label.setText("")
        self._again = None
        self.hide()

    def text(self) -> str:
        return self.label.text()

    def _retry(self) -> None:
        again, self._again = self._again, None
        self.clear()
        if again is not None:
            again()
