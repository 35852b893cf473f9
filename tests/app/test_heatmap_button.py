"""The value explorer draws a slice's heatmap and histogram by itself when the read is small; for a
larger one a labelled button says what it reads and why it waits (issue 25, item 14)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.widgets import value_explorer
from tests.app.test_window import open_by_drop


def test_draw_button_says_what_it_reads(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save({"small": torch.randn(4, 8), "large": torch.randn(64, 32)}, tmp_path / "m.pt")
    open_by_drop(qtbot, window, tmp_path / "m.pt")
    monkeypatch.setattr(value_explorer, "_AUTO_SUMMARY", 1024)  # 128 B drawn by itself, 8 KiB not
    ex = window.explorer
    window.explore("small")
    qtbot.waitUntil(lambda: ex.summary is not None, timeout=20_000)
    assert ex.summary_button.isHidden()  # drawn: nothing to ask for
    window.explore("large")
    qtbot.wait(200)
    assert ex.summary is None and not ex.summary_button.isHidden()
    assert ex.summary_button.text() == "Draw heatmap && histogram (reads 8.0 KiB)"
    assert "1.0 KiB" in ex.summary_button.toolTip() and "reads all 8.0 KiB" in ex.summary_button.toolTip()
    assert "Not drawn by itself" in ex.summary_label.text()
    ex.summary_button.click()
    qtbot.waitUntil(lambda: ex.summary is not None, timeout=20_000)
    assert ex.summary_button.isHidden() and ex.summary.count == 64 * 32
