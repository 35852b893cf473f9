"""``verify`` says how much differs first, in one line of counts, then at most 20 lines of each kind
of difference ("… and N more"); ``--all`` lists every one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    shared = {f"shared.{i}": torch.full((2,), float(i)) for i in range(5)}
    a = {**shared, **{f"model.layers.{i}.w": torch.ones(2) for i in range(30)}, "step": 3}
    b = {**shared, "shared.0": torch.full((2,), 9.0), "step": 4}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt"


def test_summary_first_and_capped_lists(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(pair[0]), str(pair[1]), "-q"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "A and B differ; equal: 4, different: 2, only in A: 30 (model.*), only in B: 0"
    only = [line for line in lines if line.startswith("  only in A:")]
    assert len(only) == 20 and lines[-1] == "  … and 10 more (--all lists them)"
    assert any("values differ: shared.0" in line for line in lines[1:3])
    assert main(["verify", str(pair[0]), str(pair[1]), "-q", "--all"]) == 1
    assert sum(line.startswith("  only in A:") for line in capsys.readouterr().out.splitlines()) == 30


def test_groups_by_first_component(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"model.w": torch.ones(1), "optim.m": torch.ones(1), "optim.v": torch.ones(1)}, tmp_path / "a.pt")
    torch.save({"other": torch.ones(1)}, tmp_path / "b.pt")
    assert main(["verify", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-q"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "A and B differ; equal: 0, different: 0, only in A: 3 (optim.* 2, model.* 1), only in B: 1 (other)"
