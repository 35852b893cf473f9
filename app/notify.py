"""Every error reaches the user through :class:`Notifier`, as a message they can act on.

Core raises domain exceptions with one-line messages; here each kind gets its advice (a hostile
pickle offers to open the file trusting it; a corrupt file is named). Unexpected exceptions --
including those escaping Qt slots or threads, through the hooks installed here -- are shown as
one line too, never as a traceback dialog.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType

from PySide6.QtCore import QObject, Signal

from dcpstudio.core import (
    CorruptCheckpointError,
    DestinationExistsError,
    MissingClassError,
    UnsafePickleError,
    UnsupportedFormatError,
)

from .widgets.message_bar import MessageBar

__all__ = ["Notifier"]


class Notifier(QObject):
    _from_thread = Signal(object)

    def __init__(self, bar: MessageBar) -> None:
        super().__init__()
        self.bar = bar
        self.last_error: BaseException | None = None
        self._from_thread.connect(self.error)

    def info(self, text: str, actions: list[tuple[str, Callable[[], None]]] | None = None) -> None:
        self.bar.show_message(text, "info", actions)

    def error(self, exc: BaseException, actions: list[tuple[str, Callable[[], None]]] | None = None) -> None:
        self.last_error = exc
        text = str(exc) or type(exc).__name__
        if isinstance(exc, UnsafePickleError):
            source = exc.source or "The file"
            what = f"'{exc.what}'" if exc.what else "an object"
            text = (
                f"Refused: {source} holds a pickle that refers to {what}, which could run code when loaded; "
                "nothing from it was run."
                + (" Trust the file only if you know where it comes from." if actions else "")
            )
        elif isinstance(exc, MissingClassError):
            text = f"Cannot load: {text}"
        elif isinstance(exc, CorruptCheckpointError):
            text = f"Damaged checkpoint: {text}"
        elif isinstance(exc, UnsupportedFormatError):
            text = text if "not a checkpoint" in text.lower() else f"Not readable: {text}"
        elif isinstance(exc, DestinationExistsError):
            text = f"Not written: {text}"
        elif isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "allocate" in str(exc)):
            text = "Not enough memory for this operation; close other programs or pick a smaller tensor."
        elif not isinstance(exc, (OSError, ValueError)) and type(exc).__module__.split(".")[0] != "dcpstudio":
            text = f"Unexpected {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        self.bar.show_message(text, "error", actions)

    def install_hooks(self) -> None:
        """Route uncaught exceptions (GUI thread and other threads) here instead of stderr."""

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            traceback.print_exception(kind, exc, tb, file=sys.stderr)
            self._from_thread.emit(exc)

        sys.excepthook = hook
        threading.excepthook = lambda args: hook(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
