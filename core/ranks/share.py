"""A rank's share of a distributed conversion as it is written: its progress, the cancel token,
and the tests' fault injection -- the same for positioned writes (:mod:`.convert`) and uploads
(:mod:`.upload`)."""

from __future__ import annotations

import os
import signal

from ..progress import CancelToken, Progress, ProgressCallback

__all__ = ["ShareProgress"]


class ShareProgress:
    """``advance(n)``: ``n`` more bytes of this rank's ``share`` done, reported as ``rank N``
    progress; a rank the environment variable ``kill`` names (``N``) kills itself there (after its
    first block), as a rank dying midway would -- or, named ``N:parent``, sends its parent SIGTERM
    there, as a user stopping the command midway would. ``check()`` raises once ``cancel`` is set."""

    def __init__(
        self, rank: int, share: int, progress: ProgressCallback | None, cancel: CancelToken | None, kill: str
    ) -> None:
        self.rank, self.share, self.done = rank, share, 0
        self._progress, self._cancel = progress, cancel
        named, _, how = (os.environ.get(kill) or "").partition(":")
        self._killed = how if named and int(named) == rank else None

    def advance(self, n: int) -> None:
        self.done += n
        if self._killed == "parent":
            self._killed = None
            os.kill(os.getppid(), signal.SIGTERM)
        elif self._killed is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._progress is not None:
            self._progress(Progress(self.done, self.share, 0, 0, f"rank {self.rank}"))

    def check(self) -> None:
        if self._cancel is not None:
            self._cancel.check()
