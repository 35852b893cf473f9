"""Reading structure and moving bytes never import torch (seconds of start-up): the command line
answers at once and the window paints before PyTorch is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dcpstudio.core import torch_save_to_dcp
from tests.conftest import rich_state_dict


@pytest.fixture
def checkpoints(tmp_path: Path) -> dict[str, Path]:
    pt = tmp_path / "model.pt"
    torch.save(rich_state_dict(), pt)
    torch_save_to_dcp(pt, tmp_path / "model_dcp")
    save_file({"a": torch.ones(3, 2), "b": torch.arange(4)}, tmp_path / "model.safetensors")
    return {"torch": pt, "dcp": tmp_path / "model_dcp", "safetensors": tmp_path / "model.safetensors"}


def _without_torch(code: str, tmp_path: Path) -> str:
    """Run ``code`` in a fresh interpreter and fail if it imported torch."""
    script = textwrap.dedent(code) + "\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_inspect_and_convert_do_not_import_torch(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Tensors whose bytes lie in place move without torch (views and casts need it, and import it)."""
    plain = tmp_path / "plain.pt"
    w = torch.randn(8, 4)
    sd = {"model": {"w": w, "tied": w, "b": torch.ones(4).bfloat16(), "u16": torch.arange(3).to(torch.uint16)}}
    torch.save({**sd, "step": 3, "betas": (0.9, 0.99), "opt": [{"lr": 0.1}]}, plain)
    out = _without_torch(
        f"""
        from dcpstudio.cli.main import main
        for path in {[str(p) for p in checkpoints.values()]!r}:
            assert main(["inspect", path, "--chunks"]) == 0
            assert main(["inspect", path, "--json"]) == 0
        assert main(["convert", {str(plain)!r}, {str(tmp_path / "a_dcp")!r}, "-q"]) == 0
        assert main(["convert", {str(tmp_path / "a_dcp")!r}, {str(tmp_path / "a.pt")!r}, "-q"]) == 0
        st = {str(tmp_path / "a.st")!r}
        assert main(["convert", {str(checkpoints["dcp"])!r}, st, "--to", "safetensors", "-q"]) == 0
        assert main(["convert", {str(checkpoints["safetensors"])!r}, {str(tmp_path / "b_dcp")!r}, "-q"]) == 0
        """,
        tmp_path,
    )
    assert "model.pt (torch)" in out and "model_dcp (dcp)" in out
    back = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(back["model"]["tied"], w) and back["model"]["u16"].dtype == torch.uint16
    assert back["step"] == 3 and back["betas"] == (0.9, 0.99) and back["opt"] == [{"lr": 0.1}]


def test_the_window_opens_a_checkpoint_before_torch_is_loaded(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    _without_torch(
        f"""
        from PySide6.QtWidgets import QApplication
        app = QApplication([])
        from dcpstudio.window.main_window import MainWindow
        from pathlib import Path
        for path in {[str(p) for p in checkpoints.values()]!r}:
            w = MainWindow()
            w.show()
            w.open_path(Path(path))
            while w.ckpt is None or str(w.ckpt.path) != path:
                app.processEvents()
                assert w.jobs["open"].running or w.ckpt is not None, "opening failed"
            w.close()
        """,
        tmp_path,
    )
