from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._gui import qt_settings, window  # noqa: F401 - fixtures for the tests here

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(autouse=True)
def isolated_settings(request: pytest.FixtureRequest) -> Path:
    """Every window test keeps its settings under its temporary directory."""
    return Path(request.getfixturevalue("qt_settings"))
