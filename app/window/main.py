"""Start the window: ``dcpstudio`` (optionally with paths to open) and ``dcpstudio --demo``."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PySide6.QtWidgets import QWidget

    from .main_window import MainWindow

__all__ = ["create_window", "run"]


def create_window(paths: Sequence[str] = (), *, demo: bool = False) -> MainWindow:
    """The configured, shown main window (the QApplication must exist)."""
    from PySide6.QtWidgets import QApplication

    from .main_window import MainWindow

    app = QApplication.instance()
    style = Path(__file__).with_name("style.qss")
    if isinstance(app, QApplication) and style.is_file():
        app.setStyleSheet(style.read_text())
    if isinstance(app, QApplication):
        from PySide6.QtGui import QIcon

        icon = resources.files("dcpstudio.resources").joinpath("dcpstudio.svg")
        if icon.is_file():
            app.setWindowIcon(QIcon(str(icon)))
    window = MainWindow()
    window.show()  # first: everything below runs on worker threads
    _trace_startup(window)
    if demo:
        window.open_demo()
    elif paths:
        window.open_path(paths[0])  # a path or a URL
    _load_torch_once_open(window)
    return window


def _load_torch_once_open(window: MainWindow) -> None:
    """Start importing PyTorch once the first frame is on screen and the checkpoint asked for on
    the command line (or the demo) is shown: that import holds the GIL for seconds, and opening
    needs no torch, so the two do not share the interpreter while the user waits for the tree."""
    from PySide6.QtCore import QTimer

    timer = QTimer(window)
    timer.setInterval(50)

    def check() -> None:
        if not any(kind in window.jobs and window.jobs[kind].running for kind in ("demo", "open")):
            timer.stop()
            timer.deleteLater()
            window.load_torch_in_background()

    timer.timeout.connect(check)
    timer.start()


def _trace_startup(window: MainWindow) -> None:
    """For tests/perf/bench_startup.py: with ``DCPSTUDIO_STARTUP_TRACE=FILE``, the wall-clock times
    of the window's first paint (``paint T``) and of the first paint of the tree with rows in it
    (``tree T``: what the user sees, not when the model was set) are appended to FILE."""
    target = os.environ.get("DCPSTUDIO_STARTUP_TRACE", "")
    if not target:
        return
    from PySide6.QtCore import QEvent, QObject

    tree = window.tree_pane.view

    class _Probe(QObject):
        def eventFilter(self, watched: QObject, event: QEvent) -> bool:
            if event.type() == QEvent.Type.Paint:
                if watched is window:
                    mark = "paint"
                elif tree.model() is not None and tree.model().rowCount() > 0:
                    mark = "tree"
                else:
                    return False
                with open(target, "a") as f:
                    f.write(f"{mark} {time.time():.6f}\n")
                watched.removeEventFilter(self)
            return False

    probe = _Probe(window)
    window.installEventFilter(probe)
    tree.viewport().installEventFilter(probe)


_NOISE = ("This plugin does not support propagateSizeHints()",)  # offscreen platform chatter, not a problem


def _quiet_qt_noise() -> None:
    """Qt's own messages go to stderr as usual, except known chatter that means nothing to a user."""
    from PySide6.QtCore import QtMsgType, qInstallMessageHandler

    def handler(kind: QtMsgType, context: object, message: str) -> None:
        if message not in _NOISE:
            print(message, file=sys.stderr)

    qInstallMessageHandler(handler)


def run(paths: Sequence[str] = (), *, demo: bool = False, quit_after: float | None = None) -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from .workers import exit_if_stuck

    if QApplication.instance() is None:
        from .display import display_problem

        problem = display_problem()
        if problem is not None:
            from dcpstudio.core.errors import DCPStudioError

            raise DCPStudioError(problem)
    _quiet_qt_noise()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("DCP Studio")
    app.setOrganizationName("DCPStudio")
    window = create_window(paths, demo=demo)
    window.notifier.install_hooks()
    if quit_after is not None:
        QTimer.singleShot(int(quit_after * 1000), window.close)
    _close_on_termination(window)
    code = int(app.exec())
    exit_if_stuck(code)  # a job stuck where it cannot be cancelled must not keep the process, or abort it
    return code


def _close_on_termination(window: QWidget) -> None:
    """SIGTERM and SIGHUP close the window like its Quit action: running jobs are cancelled and
    their temporary outputs removed. (Python runs signal handlers between bytecodes; a timer gives
    it some while Qt's event loop waits.)"""
    import signal

    from PySide6.QtCore import QTimer

    def close(signum: int, frame: object) -> None:
        window.close()

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), close)
    tick = QTimer(window)
    tick.timeout.connect(lambda: None)
    tick.start(250)
