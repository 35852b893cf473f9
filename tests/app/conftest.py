from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path: Path, qapp: object) -> Iterator[Path]:
    """QSettings written under the test's temporary directory, never the user's."""
    from PySide6.QtCore import QSettings

    where = tmp_path / "settings"
    for fmt in (QSettings.Format.NativeFormat, QSettings.Format.IniFormat):
        QSettings.setPath(fmt, QSettings.Scope.UserScope, str(where))
    yield where


@pytest.fixture
def window(qtbot: object) -> Iterator[object]:
    from dcpstudio.app.main_window import MainWindow

    w = MainWindow()
    qtbot.addWidget(w)  # type: ignore[attr-defined]
    w.show()
    yield w
    w.close()
