"""Closing the window while jobs are stuck where no cancel reaches them (a remote read that never
returns, issue 24 item 8): the process exits at once and cleanly -- no "QThread: Destroyed while
thread is still running" abort, no wait on the stuck threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import sys, threading
from concurrent.futures import ThreadPoolExecutor
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from dcpstudio.window.main import run

app = QApplication(sys.argv[:1])
pool = ThreadPoolExecutor(1)

def stuck(progress, cancel):  # never returns and never looks at cancel
    pool.submit(threading.Event().wait)  # a worker thread of its own, stuck too
    threading.Event().wait()

def start():
    (window,) = [w for w in app.topLevelWidgets() if type(w).__name__ == "MainWindow"]
    window.board.start("open", stuck, lambda r: None)
    window.board.start("convert", stuck, lambda r: None)
    window.board.start("convert", stuck, lambda r: None)  # the first one is now retired, still stuck
    QTimer.singleShot(200, lambda: (print("closing", flush=True), window.close()))

QTimer.singleShot(300, start)
sys.exit(run())
"""


def test_closing_with_stuck_jobs_exits_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CONFIG_HOME": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "closing"
        closed = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    took = time.monotonic() - closed
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert took < 6, f"exited {took:.1f} s after the close"  # the bounded wait is 2 s for all jobs
    assert "QThread" not in err and "Abort" not in err and "Traceback" not in err, err


def test_no_job_starts_once_the_board_has_stopped(qapp: object) -> None:
    """A result queued before the window closed may ask for more work (the tree shown, then the
    background import of torch): nothing starts, so the window's destruction never meets a running
    QThread -- Qt aborts the process on that ("Destroyed while thread is still running")."""
    from PySide6.QtCore import QObject

    from dcpstudio.window.jobs import JobBoard

    owner = QObject()
    board = JobBoard(owner, on_error=lambda kind, error, job: None)
    board.stop_all()
    job = board.start("late", lambda progress, cancel: time.sleep(5), lambda result: None)
    assert not job.is_alive() and not job.running
    del owner  # destroying the owner (and the job's QThread) is safe: it never ran
