"""The Convert panel's outcome: a few lines that say how a conversion or a verification ended --
the summary first, then the details, scrolling -- and "Details…", which shows the whole text in a
window of its own, so a long report is read at a comfortable size while the panel never grows."""

from __future__ import annotations

from typing import Literal

from PySide6.QtWidgets import QDialog, QHBoxLayout, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

__all__ = ["OutcomeBox", "State"]

State = Literal["", "ok", "differ", "error"]
HEIGHT = 76  # a long report scrolls inside the box; the window never grows


class OutcomeBox(QWidget):
    """``text`` is the box; :meth:`show_outcome` sets it with a ``state`` (``style.qss`` colours it:
    an error or a difference is seen before it is read)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.text = QPlainTextEdit()
        self.text.setObjectName("outcome")
        self.text.setReadOnly(True)
        self.text.setMaximumBlockCount(5000)
        self.text.setFixedHeight(HEIGHT)
        self.text.setPlaceholderText("The outcome of a conversion or verification appears here.")
        self.text.textChanged.connect(self._changed)
        self.details_button = QPushButton("Details…")
        self.details_button.setToolTip("The whole outcome in a window of its own, selectable and copyable")
        self.details_button.clicked.connect(self.show_details)
        self.dialog: QDialog | None = None
        self._details = QPlainTextEdit()
        self._details.setReadOnly(True)
        self._details.setObjectName("outcomeDetails")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.text, 1)
        side = QVBoxLayout()
        side.addWidget(self.details_button)
        side.addStretch(1)
        lay.addLayout(side)
        self._changed()

    def show_outcome(self, text: str, state: State = "") -> None:
        self.text.setPlainText(text)
        self.set_state(state)

    def set_state(self, state: State) -> None:
        if self.text.property("state") != state:
            self.text.setProperty("state", state)
            self.text.style().unpolish(self.text)
            self.text.style().polish(self.text)

    @property
    def state(self) -> State:
        return self.text.property("state") or ""

    def _changed(self) -> None:
        self.details_button.setEnabled(bool(self.text.toPlainText()))
        if not self.text.toPlainText():
            self.set_state("")

    def show_details(self) -> QDialog:
        """The whole text, in a resizable window (one at a time; it follows the box's next outcome
        only when opened again)."""
        if self.dialog is None:
            self.dialog = QDialog(self)
            self.dialog.setWindowTitle("Outcome")
            self.dialog.resize(760, 480)
            QVBoxLayout(self.dialog).addWidget(self._details)
        self._details.setPlainText(self.text.toPlainText())
        self.dialog.show()
        self.dialog.raise_()
        return self.dialog
