"""The one bridge between core's progress/cancel contract and Qt: a job on its own QThread.

A job is a plain function ``fn(progress, cancel) -> result`` -- every long core operation has
that shape. :class:`Job` runs it on a fresh ``QThread`` and turns what happens into signals,
delivered on the GUI thread: ``progress(Progress)`` (throttled), ``result(object)``,
``errored(Exception)``, ``cancelled()``, and always ``finished()`` last. Cancellation is
cooperative: :meth:`Job.cancel` sets the token the function polls. A job whose function never
looks (a read stuck in the network) cannot be stopped: when the window closes it is
:meth:`Job.abandon`-ed, and the process ends with :func:`exit_if_stuck`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from dcpstudio.core import CancelledError, CancelToken, Progress

__all__ = ["Job", "JobFunction", "exit_if_stuck", "stuck_jobs"]

JobFunction = Callable[[Callable[[Progress], None], CancelToken], Any]


class _Runner(QObject):
    progress = Signal(object)
    result = Signal(object)
    errored = Signal(object)
    cancelled = Signal()
    done = Signal()

    def __init__(self, fn: JobFunction, token: CancelToken, interval: float) -> None:
        super().__init__()
        self._fn: JobFunction | None = fn
        self._token = token
        self._interval = interval
        self._last = 0.0

    def _report(self, p: Progress) -> None:
        now = time.monotonic()
        if not isinstance(p, Progress) or now - self._last >= self._interval or p.fraction >= 1.0:
            self._last = now
            self.progress.emit(p)

    @Slot()
    def run(self) -> None:
        try:
            fn, self._fn = self._fn, None  # what it holds (a checkpoint, say) does not live on with the job
            assert fn is not None  # a runner runs once
            value = fn(self._report, self._token)
        except CancelledError:
            self.cancelled.emit()
        except Exception as e:  # every failure becomes a signal; the notifier shows it
            self.errored.emit(e)
        else:
            if self._token.cancelled:
                self.cancelled.emit()
            else:
                self.result.emit(value)
        finally:
            self.done.emit()


class Job(QObject):
    """Run ``fn`` on a worker thread. Keep a reference until ``finished`` is emitted."""

    progress = Signal(object)
    result = Signal(object)
    errored = Signal(object)
    cancelled = Signal()
    finished = Signal()

    def __init__(
        self, fn: JobFunction, name: str = "job", parent: QObject | None = None, interval: float = 0.05
    ) -> None:
        super().__init__(parent)
        self.name = name
        self.token = CancelToken()
        self._thread = QThread(self)  # owned by the job: never destroyed while the job object lives
        self._thread.setObjectName(f"dcpstudio-{name}")
        self._runner = _Runner(fn, self.token, interval)
        self._runner.moveToThread(self._thread)
        self._thread.started.connect(self._runner.run)
        self._runner.progress.connect(self.progress)
        self._runner.result.connect(self.result)
        self._runner.errored.connect(self.errored)
        self._runner.cancelled.connect(self.cancelled)
        # direct: the thread must stop even while the GUI thread is blocked in wait() (closing)
        self._runner.done.connect(self._thread.quit, Qt.ConnectionType.DirectConnection)
        self._thread.finished.connect(self._on_thread_finished)
        self.running = False

    def start(self) -> Job:
        self.running = True
        self._thread.start()
        return self

    def cancel(self) -> None:
        self.token.cancel()

    def is_alive(self) -> bool:
        """Whether the worker thread still runs (``running`` turns False only once ``finished``
        has been delivered to the GUI thread)."""
        return self._thread.isRunning()

    def wait(self, timeout_ms: int = 30_000) -> bool:
        """Block until the thread has ended (used when the window closes). True if it ended."""
        return self._thread.wait(timeout_ms)

    def abandon(self) -> None:
        """Let go of a job whose thread will not end: nothing it does reaches its receivers any
        more, and it no longer belongs to its parent, which may now be destroyed -- destroying a
        running QThread aborts the process. It is kept (:func:`stuck_jobs`) until its thread ends."""
        self.blockSignals(True)
        self.setParent(None)
        _ABANDONED.add(self)

    def _on_thread_finished(self) -> None:
        self.running = False
        if self in _ABANDONED:
            _ABANDONED.discard(self)
            # QThread's finished() is emitted from the thread just before it exits: destroying the
            # QThread before it has is fatal ("Destroyed while thread is still running")
            self._thread.wait(1_000)
            self.deleteLater()
        self.finished.emit()


_ABANDONED: set[Job] = set()


def stuck_jobs() -> list[Job]:
    """The abandoned jobs whose threads still run."""
    return [job for job in _ABANDONED if job.is_alive()]


def exit_if_stuck(code: int) -> None:
    """End the process now with ``code`` when an abandoned job's thread still runs. Python cannot
    stop that thread, and a normal exit would wait on it or abort: finalization destroys the
    running QThread (Qt aborts: "Destroyed while thread is still running") and joins the worker
    threads it may have started. ``os._exit`` skips both; the window has saved its settings and
    cancelled everything that listens, so only the streams need flushing."""
    if stuck_jobs():
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(code)
