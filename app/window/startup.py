"""Two start-up jobs of the window: PyTorch imported in the background, and the demo opened
(written first only when no unchanged copy of it is found: writing needs torch, opening does not)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QLabel

from .jobs import JobBoard
from .settings import Settings
from .widgets.file_browser import FileBrowser
from .workers import Job

__all__ = ["load_torch_in_background", "open_demo"]


def load_torch_in_background(board: JobBoard, status: QLabel) -> Job:
    """Import PyTorch and its DCP package (seconds of CPU) on a worker thread while the window is
    already in use: browsing, opening any checkpoint and converting need none of it. Previews,
    statistics, verify and multi-rank load import it when they run; a worker that gets there
    first waits for this import, never the GUI thread."""
    status.setText("Loading PyTorch…")

    def work(progress: Any, cancel: Any) -> str:
        import torch
        import torch.distributed.checkpoint

        import dcpstudio.core.formats.dcp.storage  # noqa: F401

        return str(torch.__version__)

    def done(version: str) -> None:
        status.setText("")
        status.setToolTip(f"PyTorch {version}")

    job = board.start("torch", work, done)
    job.errored.connect(lambda e: status.setText("PyTorch failed to load"))
    return job


def open_demo(
    board: JobBoard, activity: QLabel, settings: Settings, browser: FileBrowser, open_path: Callable[[Path], None]
) -> Job:
    """Find or write the demo checkpoints (a worker job), then open the DCP one, shown in the browser."""

    def work(progress: Any, cancel: Any) -> tuple[Path, Path]:
        from dcpstudio.core.ops.demo import write_demo, written_demo

        found = written_demo()  # a listing of its folder: here, not on the GUI thread
        if found is not None:
            return found
        progress("Writing the demo checkpoints…")
        return write_demo()

    def done(paths: tuple[Path, Path]) -> None:
        pt, dcp_dir = paths
        settings.add_recent(pt)
        browser.set_root(str(dcp_dir.parent))
        open_path(dcp_dir)

    return board.start("demo", work, done, lambda: activity.setText(""), activity.setText)
