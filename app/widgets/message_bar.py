"""The one place messages appear: a bar above the content with text and optional actions."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

__all__ = ["MessageBar"]


class MessageBar(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("messageBar")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self._layout = QHBoxLayout(self)
        self._layout.addWidget(self.label, 1)
        self.buttons: list[QPushButton] = []
        close = QPushButton("✕")
        close.setFlat(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.hide)
        self._close = close
        self._layout.addWidget(close)
        self.level = "info"
        self.hide()

    def show_message(
        self, text: str, level: str = "info", actions: list[tuple[str, Callable[[], None]]] | None = None
    ) -> None:
        for b in self.buttons:
            self._layout.removeWidget(b)
            b.deleteLater()
        self.buttons = []
        for title, callback in actions or []:
            b = QPushButton(title)
            b.clicked.connect(callback)
            b.clicked.connect(self.hide)
            self._layout.insertWidget(self._layout.count() - 1, b)
            self.buttons.append(b)
        self.level = level
        self.setProperty("level", level)
        self.style().unpolish(self)
        self.style().polish(self)
        self.label.setText(text)
        self.show()

    def text(self) -> str:
        return self.label.text()
