"""A button that takes a dropped checkpoint, and shows while a drag hovers it that it will."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QDragEnterEvent, QDragLeaveEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import QPushButton, QWidget

from ..locations import accept_copy, dropped_locations

__all__ = ["DropButton"]


class DropButton(QPushButton):
    """A button that also takes a dropped file, directory or URL (``dropped(location)``). While a
    drag it would take hovers it, its ``dropHover`` property is true (``style.qss`` highlights
    it), so a user sees which target a drop goes to before letting go."""

    dropped = Signal(object)

    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setAcceptDrops(True)
        self.setProperty("dropHover", False)

    def _hover(self, on: bool) -> None:
        if self.property("dropHover") != on:
            self.setProperty("dropHover", on)
            self.style().unpolish(self)
            self.style().polish(self)

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        self._hover(accept_copy(event))

    def dragMoveEvent(self, event: QDragMoveEvent) -> None:
        accept_copy(event)

    def dragLeaveEvent(self, event: QDragLeaveEvent) -> None:
        self._hover(False)

    def dropEvent(self, event: QDropEvent) -> None:
        self._hover(False)
        if accept_copy(event):
            self.dropped.emit(dropped_locations(event)[0])
