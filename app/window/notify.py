"""Every error reaches the user through :class:`Notifier`, as a message they can act on.

Core raises domain exceptions with one-line messages; here each kind gets its advice (a hostile
pickle offers to open the file trusting it; a corrupt file is named). Unexpected exceptions --
including those escaping Qt slots or threads, through the hooks installed here -- are shown as
one line too, never as a traceback dialog.
"""

from __future__ import annotations

import re
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

__all__ = ["Notifier", "describe"]

_CLASS_PREFIX = re.compile(r"\b[A-Z]\w*(?:Error|Exception): ")


def describe(exc: BaseException, *, trust_offered: bool = False) -> str:
    """The one line a user reads for ``exc`` -- in the status bar and in the pane that asked
    (``trust_offered``: the message offers to open a refused pickle trusting it)."""
    text = _CLASS_PREFIX.sub("", str(exc)) or type(exc).__name__  # a rank's error names its class: not news
    if isinstance(exc, UnsafePickleError):
        source = exc.source or "The file"
        what = f"'{exc.what}'" if exc.what else "an object"
        return (
            f"Refused: {source} holds a pickle that refers to {what}, which could run code when loaded; "
            "nothing from it was run."
            + (" Trust the file only if you know where it comes from." if trust_offered else "")
        )
    if isinstance(exc, MissingClassError):
        return f"Cannot load: {text}"
    if isinstance(exc, CorruptCheckpointError):
        return f"Damaged checkpoint: {text}"
    if isinstance(exc, UnsupportedFormatError):
        return text if "not a checkpoint" in text.lower() else f"Not readable: {text}"
    if isinstance(exc, DestinationExistsError):
        return f"Not written: {text}"
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "allocate" in str(exc)):
        return "Not enough memory for this operation; close other programs or pick a smaller tensor."
    if not isinstance(exc, (OSError, ValueError)) and type(exc).__module__.split(".")[0] != "dcpstudio":
        return f"Unexpected {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return text


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
        self.bar.show_message(describe(exc, trust_offered=bool(actions)), "error", actions)

    def install_hooks(self) -> None:
        """Route uncaught exceptions (GUI thread and other threads) here instead of stderr."""

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            traceback.print_exception(kind, exc, tb, file=sys.stderr)
            self._from_thread.emit(exc)

        sys.excepthook = hook
        threading.excepthook = lambda args: hook(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
