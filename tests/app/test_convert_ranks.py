"""The Convert panel's "Ranks" choice: the same conversion on N local ranks, as a Job with a bar per
rank, writing the bytes one process writes (its manifest included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert
from dcpstudio.window.main_window import MainWindow


def test_convert_on_two_ranks_from_the_panel(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "window")
    torch.save({"w": torch.randn(300, 200), "b": torch.randn(7).to(torch.bfloat16)}, tmp_path / "src.pt")
    (tmp_path / "one").mkdir()
    convert(tmp_path / "src.pt", tmp_path / "one" / "out.safetensors", to="safetensors", dtype="bf16")
    panel = window.panel
    assert panel.ranks.spin.maximum() >= 2
    panel.ranks.spin.setValue(2)
    panel.dtype.setCurrentText("bf16")
    (tmp_path / "many").mkdir()
    dst = tmp_path / "many" / "out.safetensors"
    panel.convert("safetensors", tmp_path / "src.pt", dst)
    assert len(panel.ranks._bars) == 2
    qtbot.waitUntil(lambda: panel.last_result is not None, timeout=60_000)
    assert dst.read_bytes() == (tmp_path / "one" / "out.safetensors").read_bytes()
    assert [b.value() for b in panel.ranks._bars] == [100, 100]
    assert "on 2 ranks: rank 0" in panel.report.toPlainText()
    assert b"dcpstudio.manifest" in dst.read_bytes()[:4096]
