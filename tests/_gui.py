"""What the window tests share: a main window with settings kept out of the user's, and what they
measure of the GUI thread."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Heartbeat", "qt_settings", "window"]


class Heartbeat:
    """A 10 ms timer on the GUI thread recording the gaps between its ticks: a long gap is the GUI
    thread blocked that long. ``gaps[0]`` runs from construction to the first tick."""

    def __init__(self) -> None:
        from PySide6.QtCore import QTimer

        self.gaps: list[float] = []
        self._last = time.monotonic()
        self._timer = QTimer()
        self._timer.setInterval(10)
        self._timer.timeout.connect(self._beat)

    def _beat(self) -> None:
        now = time.monotonic()
        self.gaps.append(now - self._last)
        self._last = now

    def start(self) -> None:
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    @property
    def longest(self) -> float:
        """The longest gap after the first tick."""
        return max(self.gaps[1:])


@pytest.fixture
def qt_settings(tmp_path: Path, qapp: Any) -> Iterator[Path]:
    """QSettings written under the test's temporary directory, never the user's."""
    from PySide6.QtCore import QSettings

    where = tmp_path / "settings"
    for fmt in (QSettings.Format.NativeFormat, QSettings.Format.IniFormat):
        QSettings.setPath(fmt, QSettings.Scope.UserScope, str(where))
    yield where


@pytest.fixture
def window(qtbot: Any, qt_settings: Path) -> Iterator[Any]:
    """A shown main window, closed after the test."""
    from dcpstudio.window.main_window import MainWindow

    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    yield w
    w.close()
