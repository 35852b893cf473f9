"""View ▸ Messages: every message of the session, whole, to read, select and copy.

The status bar shows one message at a time, elided to its width; this window keeps them all
(:attr:`~.message_bar.MessageBar.log`), oldest first, and follows new ones while it is open.
"""

from __future__ import annotations

from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from .message_bar import MessageBar

__all__ = ["MessageLog"]


class MessageLog(QDialog):
    def __init__(self, bar: MessageBar, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Messages")
        self.resize(760, 360)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)  # still selectable and copyable, with the mouse and the keyboard
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.text.setPlaceholderText("No messages yet.")
        self.text.setPlainText("\n".join(bar.log))
        bar.logged.connect(self.text.appendPlainText)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        copy = QPushButton("Copy All")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.text.toPlainText()))
        buttons.addButton(copy, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.rejected.connect(self.close)
        lay = QVBoxLayout(self)
        lay.addWidget(self.text)
        lay.addWidget(buttons)

    @staticmethod
    def show_for(bar: MessageBar, parent: QWidget) -> MessageLog:
        """The parent's one log window, shown and raised (made on first use)."""
        log = parent.findChild(MessageLog)
        if log is None:
            log = MessageLog(bar, parent)
        log.show()
        log.raise_()
        log.activateWindow()
        return log
