"""The one place messages appear: a strip in the status bar with text and optional actions.

It sits in the status bar, which is always there, so a message never pushes the window's content
around (a drop aimed at a button lands on the button). A long message is elided; the whole text
is its tooltip and :meth:`MessageBar.text`, and every message of the session is kept whole in
:attr:`MessageBar.log` (View ▸ Messages shows it; ``logged`` announces each new line).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QWidget

__all__ = ["MessageBar"]


class _ElidedLabel(QLabel):
    def __init__(self) -> None:
        super().__init__()
        self.full = ""
        self.setTextFormat(Qt.TextFormat.PlainText)  # messages quote names from files: never markup
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    def set_full_text(self, text: str) -> None:
        self.full = text
        self.setToolTip(text if text else "")
        self._elide()

    def _elide(self) -> None:
        one_line = " ".join(self.full.split())
        super().setText(self.fontMetrics().elidedText(one_line, Qt.TextElideMode.ElideRight, max(self.width(), 40)))

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._elide()


class MessageBar(QFrame):
    logged = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.log: list[str] = []
        self.setObjectName("messageBar")
        self.label = _ElidedLabel()
        self._layout = QHBoxLayout(self)
        self._layout.setContentsMargins(6, 0, 2, 0)
        self._layout.addWidget(self.label, 1)
        self.buttons: list[QPushButton] = []
        close = QPushButton("✕")
        close.setFlat(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.clear)
        self._close = close
        self._layout.addWidget(close)
        self.level = "none"
        self.setFixedHeight(QPushButton("Open").sizeHint().height() + 2)  # with or without buttons
        self.clear()

    @property
    def showing(self) -> bool:
        """Whether a message is shown (the strip itself is always there)."""
        return bool(self.label.full)

    def clear(self) -> None:
        self._set_buttons([])
        self.label.set_full_text("")
        self._set_level("none")
        self._close.setVisible(False)

    def show_message(
        self, text: str, level: str = "info", actions: list[tuple[str, Callable[[], None]]] | None = None
    ) -> None:
        self._set_buttons(actions or [])
        self._set_level(level)
        self.label.set_full_text(text)
        self._close.setVisible(True)
        line = f"{time.strftime('%H:%M:%S')}  {'error' if level == 'error' else 'info '}  {text}"
        self.log.append(line)
        self.logged.emit(line)

    def _set_level(self, level: str) -> None:
        self.level = level
        self.setProperty("level", level)
        self.style().unpolish(self)
        self.style().polish(self)

    def _set_buttons(self, actions: list[tuple[str, Callable[[], None]]]) -> None:
        for b in self.buttons:
            self._layout.removeWidget(b)
            b.deleteLater()
        self.buttons = []
        for title, callback in actions:
            b = QPushButton(title)
            b.clicked.connect(self.clear)
            b.clicked.connect(callback)
            self._layout.insertWidget(self._layout.count() - 1, b)
            self.buttons.append(b)

    def text(self) -> str:
        return self.label.full
