"""The Convert panel and the total output bound (issue 24, item 5): an output refused as many times
larger than its source is written only when the user says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.window.main_window import MainWindow


@pytest.mark.parametrize("answer", [False, True])
def test_convert_asks_before_writing_a_fanned_out_storage(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: bool
) -> None:
    monkeypatch.setattr("dcpstudio.core.ops.convert.fanout.OUTPUT_FLOOR", 1 << 20)
    storage = torch.arange(64 << 10, dtype=torch.float32)
    torch.save({f"w{i}": storage[i:] for i in range(64)}, tmp_path / "fan.pt")
    dst = tmp_path / "out.safetensors"
    asked: list[str] = []
    window.confirm = lambda text: asked.append(text) or answer  # type: ignore[method-assign]
    window.panel.convert("safetensors", tmp_path / "fan.pt", dst)
    qtbot.waitUntil(lambda: bool(asked), timeout=30_000)
    assert "64 entries view one storage ('w0' is one)" in asked[0] and "Write it anyway?" in asked[0], asked
    if answer:
        qtbot.waitUntil(lambda: window.panel.last_result is not None, timeout=30_000)
        from safetensors.torch import load_file

        assert len(load_file(dst)) == 64
    else:
        qtbot.waitUntil(lambda: not window.jobs["convert"].running, timeout=30_000)
        assert not dst.exists()
    assert len(asked) == 1
