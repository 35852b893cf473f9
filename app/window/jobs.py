"""One running job per kind (open, preview, convert, verify, load, ...): starting a new one
cancels the old, which is kept alive until its thread ends, then deleted -- a finished job replaced is
deleted at once, with the callbacks connected to it (closures over a checkpoint the window may have
closed since); closing cancels all and waits a bounded time, abandoning the jobs that do not end."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject

from .workers import Job, JobFunction

__all__ = ["JobBoard"]


class JobBoard:
    def __init__(
        self,
        owner: QObject,
        on_error: Callable[[str, BaseException, Job], None],
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._owner = owner
        self._on_error = on_error
        self._on_change = on_change or (lambda: None)
        self.jobs: dict[str, Job] = {}
        self.retired: set[Job] = set()  # cancelled jobs whose threads have not ended yet
        self.closed = False  # stop_all ran: the window is closing, nothing new starts

    def start(
        self,
        kind: str,
        fn: JobFunction,
        on_result: Callable[[Any], None],
        on_done: Callable[[], None] | None = None,
        on_progress: Callable[[Any], None] | None = None,
    ) -> Job:
        old = self.jobs.get(kind)
        if old is not None and old.running:
            old.cancel()
            self.retired.add(old)
            old.finished.connect(lambda o=old: self._dispose(o))
        elif old is not None:
            old.wait(1_000)  # its thread has signalled the end: let it exit before the QThread goes
            old.deleteLater()  # finished and replaced: its callbacks (and what they hold) go with it
        job = Job(fn, kind, self._owner)
        job.result.connect(on_result)
        job.errored.connect(lambda e, k=kind, j=job: self._on_error(k, e, j))
        if on_done is not None:
            job.finished.connect(on_done)
        if on_progress is not None:
            job.progress.connect(on_progress)
        job.finished.connect(self._on_change)
        self.jobs[kind] = job
        if self.closed:  # a result queued before the close asked for more work: none runs, so the
            return job  # window's destruction never meets a running thread (Qt aborts on that)
        job.start()
        self._on_change()
        return job

    def _dispose(self, job: Job) -> None:
        self.retired.discard(job)
        job.wait(1_000)  # ``finished`` comes from the thread just before it exits: let it exit first
        job.deleteLater()

    def cancel(self, kind: str) -> None:
        job = self.jobs.get(kind)
        if job is not None and job.running:
            job.cancel()

    def stop_all(self, timeout_ms: int = 2_000) -> list[Job]:
        """Cancel every job and wait, at most ``timeout_ms`` for all, for their threads to end (the
        window is closing). Those still running -- stuck where they cannot see the cancel -- are
        abandoned (:meth:`Job.abandon`) and returned."""
        self.closed = True
        jobs = [*self.jobs.values(), *self.retired]
        for job in jobs:
            if job.running:
                job.cancel()
        deadline = time.monotonic() + timeout_ms / 1000
        stuck = [job for job in jobs if not job.wait(max(0, int((deadline - time.monotonic()) * 1000)))]
        for job in stuck:
            job.abandon()
        return stuck
