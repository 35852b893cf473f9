"""``dcpstudio export CKPT NAME DST``: one tensor to .npy / .pt, with the other subcommands' errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dcpstudio.cli.main import main
from tests.conftest import leftovers, rich_state_dict


def test_export_npy_and_pt(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = rich_state_dict()["model"]
    assert main(["convert", str(rich_pt), str(tmp_path / "d"), "-q"]) == 0
    assert main(["export", str(tmp_path / "d"), "model.w", str(tmp_path / "w.npy")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert np.array_equal(np.load(tmp_path / "w.npy"), sd["w"].numpy())
    assert main(["export", str(rich_pt), "model.w_t", str(tmp_path / "w_t.data"), "--format", "pt", "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert torch.equal(torch.load(tmp_path / "w_t.data", weights_only=True), sd["w_t"])
    assert main(["export", str(rich_pt), "model.bf16", str(tmp_path / "bf.npy"), "-q"]) == 0
    assert "dcpstudio: warning:" in capsys.readouterr().err  # widened to float32, said so
    assert np.array_equal(np.load(tmp_path / "bf.npy"), sd["bf16"].float().numpy())


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["model.w", "w.npy"], 1, "--overwrite"),
        (["model.w", "w.txt"], 2, "choose .npy or .pt"),
        (["step", "s.npy"], 1, "step is not a tensor"),  # the input's fault, like a missing name: 1
        (["model.nope", "n.npy"], 1, "no entry named 'model.nope'"),
    ],
)
def test_errors_are_one_line(
    args: list[str], code: int, expected: str, rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "w.npy").write_bytes(b"keep")
    assert main(["export", str(rich_pt), args[0], str(tmp_path / args[1])]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dcpstudio: error:") and expected in err
    assert (tmp_path / "w.npy").read_bytes() == b"keep" and leftovers(tmp_path) == []


def test_overwrite_replaces(rich_pt: Path, tmp_path: Path) -> None:
    (tmp_path / "w.pt").write_bytes(b"old")
    assert main(["export", str(rich_pt), "model.w", str(tmp_path / "w.pt"), "--overwrite", "-q"]) == 0
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True), rich_state_dict()["model"]["w"])
