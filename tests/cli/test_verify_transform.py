"""``dcpstudio verify SRC OUT --include … --dtype … --strip-prefix …`` checks a conversion's output
against its source as the conversion wrote it: equal (exit 0), the summary first, then what A is;
the excluded entries are not "only in A"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main


def test_verify_through_convert_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {f"model.layers.{i}.w": torch.randn(3, 2) for i in range(3)}
    state.update({f"optim.{i}": torch.randn(2) for i in range(4)})
    torch.save(state, tmp_path / "src.pt")
    src, out = str(tmp_path / "src.pt"), str(tmp_path / "out.safetensors")
    flags = ["--include", r"^model\.", "--dtype", "bf16", "--strip-prefix", "model."]
    assert main(["convert", src, out, "-q", *flags]) == 0
    assert main(["verify", src, out, "-q"]) == 1  # the whole source: 4 only in A, 3 not found in B
    capsys.readouterr()
    assert main(["verify", src, out, "-q", *flags[:2], "--cast", "bf16", *flags[4:]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "equal: 3 entries compared",
        r"A is the source through --include '^model\.' --dtype bf16 --strip-prefix model.: 3 of 7 entries",
    ]
    assert main(["verify", src, out, "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["only_a"] == [] and report["transform"]["dtype"] == "bf16" and report["kept"] == 3


def test_verify_refuses_an_option_that_cannot_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"model.w": torch.ones(2)}, tmp_path / "src.pt")
    assert main(["convert", str(tmp_path / "src.pt"), str(tmp_path / "out_dcp"), "-q"]) == 0
    assert main(["verify", str(tmp_path / "src.pt"), str(tmp_path / "out_dcp"), "--strip-prefix", "model."]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"dcpstudio: error: --strip-prefix applies to safetensors outputs only; {tmp_path / 'out_dcp'} is a DCP "
        "checkpoint"
    )
