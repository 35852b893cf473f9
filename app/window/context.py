"""What the window lends its panes: the job board, the notifier, settings, dialogs and the open
checkpoint. Panes start their own jobs through it, so the window only wires them together; dialogs
go through it so tests (and scripts) can answer them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcpstudio.core import Checkpoint

from .jobs import JobBoard
from .notify import Notifier
from .settings import Settings
from .workers import Job

__all__ = ["Context"]


@dataclass
class Context:
    board: JobBoard
    notifier: Notifier
    settings: Settings
    checkpoint: Callable[[], Checkpoint | None]
    save_path: Callable[[str, Path, str], Path | None]  # (title, suggested path, file filter) -> chosen
    open_path: Callable[[str, bool], Path | None]  # (title, directory?) -> chosen
    confirm: Callable[[str], bool]

    def start(self, kind: str, fn: Any, on_result: Any, on_done: Any = None, on_progress: Any = None) -> Job:
        """One job per kind: a new one cancels the old (see :class:`~.jobs.JobBoard`)."""
        return self.board.start(kind, fn, on_result, on_done, on_progress)
