"""The progress / cancel contract shared by every long operation in ``core``.

A long operation takes ``progress`` (a callable receiving :class:`Progress`) and ``cancel`` (a
:class:`CancelToken`). It calls ``progress`` after each unit of work and polls the token between
units; cancellation is cooperative because Python threads cannot be killed. The CLI renders the
reports as a terminal bar, the window turns them into Qt signals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .errors import CancelledError

__all__ = ["CancelToken", "Progress", "ProgressCallback", "Reporter"]


@dataclass(frozen=True)
class Progress:
    """A snapshot of an operation's advance. ``total_bytes`` is 0 while unknown."""

    done_bytes: int
    total_bytes: int
    done_items: int
    total_items: int
    current: str = ""

    @property
    def fraction(self) -> float:
        if self.total_bytes > 0:
            return min(1.0, self.done_bytes / self.total_bytes)
        if self.total_items > 0:
            return min(1.0, self.done_items / self.total_items)
        return 0.0


ProgressCallback = Callable[[Progress], None]


class CancelToken:
    """A thread-safe flag: the requester calls :meth:`cancel`, the worker calls :meth:`check`."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise :class:`CancelledError` if cancellation was requested."""
        if self._event.is_set():
            raise CancelledError("cancelled")


class Reporter:
    """Accumulates work done and forwards it to an optional callback, checking the token each time."""

    def __init__(
        self,
        progress: ProgressCallback | None,
        cancel: CancelToken | None,
        total_bytes: int = 0,
        total_items: int = 0,
    ) -> None:
        self._progress = progress
        self._cancel = cancel
        self.total_bytes = total_bytes
        self.total_items = total_items
        self.done_bytes = 0
        self.done_items = 0

    def check(self) -> None:
        if self._cancel is not None:
            self._cancel.check()

    def advance(self, nbytes: int, items: int = 1, current: str = "") -> None:
        self.done_bytes += nbytes
        self.done_items += items
        if self._progress is not None:
            self._progress(Progress(self.done_bytes, self.total_bytes, self.done_items, self.total_items, current))
        self.check()
