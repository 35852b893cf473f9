"""``--include``/``--exclude`` that keep no entry refuse (unless ``--allow-empty``); a pattern that
matches nothing while the selection keeps entries is warned about: nothing silent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main


def test_include_matching_nothing_refuses_with_real_names(
    rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out_dcp"
    assert main(["convert", str(rich_pt), str(out), "--include", "zzz"]) == 1
    err = capsys.readouterr().err
    names = list(torch.load(rich_pt, weights_only=True)["model"])
    assert err.count("\n") == 1 and "--include 'zzz' matches no entry; names look like" in err, err
    assert f"model.{names[0]}" in err
    assert not out.exists()


def test_exclude_dropping_everything_refuses_and_allow_empty_writes(
    rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.pt"
    assert main(["convert", str(rich_pt), str(out), "--exclude", "."]) == 1
    assert "--exclude '.' drops every entry" in capsys.readouterr().err
    assert main(["convert", str(rich_pt), str(out), "--include", "^model", "--exclude", "."]) == 1
    assert "drops every entry --include '^model' keeps" in capsys.readouterr().err
    assert not out.exists()
    assert main(["convert", str(rich_pt), str(out), "--include", "zzz", "--allow-empty", "-q"]) == 0
    assert torch.load(out, weights_only=True) == {}


def test_exclude_matching_nothing_warns_in_one_line(
    rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.pt"
    assert main(["convert", str(rich_pt), str(out), "--exclude", "zzz", "-q"]) == 0
    err = capsys.readouterr().err
    assert err == "dcpstudio: warning: --exclude 'zzz' matches no entry; nothing was excluded\n"
