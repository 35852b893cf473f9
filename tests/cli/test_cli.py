"""The ``dcpstudio`` command: exit codes, one-line errors, format_utils-compatible subcommands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcpstudio.cli import main
from tests.conftest import assert_same, rich_state_dict


def test_convert_both_ways_infers_target(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(rich_pt), str(tmp_path / "d")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "d"), str(tmp_path / "back.pt"), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert_same(rich_state_dict(), torch.load(tmp_path / "back.pt", weights_only=True))


def test_format_utils_subcommands(rich_pt: Path, tmp_path: Path) -> None:
    assert main(["torch_to_dcp", str(rich_pt), str(tmp_path / "d"), "-q"]) == 0
    assert main(["dcp_to_torch", str(tmp_path / "d"), str(tmp_path / "b.pt"), "-q"]) == 0
    assert main(["dcp-to-torch", str(tmp_path / "d"), str(tmp_path / "b.pt"), "-q", "--overwrite"]) == 0
    assert_same(rich_state_dict(), torch.load(tmp_path / "b.pt", weights_only=True))


def test_wrong_direction_is_an_error(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dcp_to_torch", str(rich_pt), str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dcpstudio: error:") and "already a torch.save file" in err


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("garbage", "not a checkpoint"),
        ("exists", "--overwrite"),
        ("hostile", "--trust-pickle"),
        ("missing", "no such file"),
    ],
)
def test_errors_are_one_line(
    setup: str, expected: str, rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = rich_pt, tmp_path / "out"
    if setup == "garbage":
        src = tmp_path / "g.bin"
        src.write_bytes(b"hello world, not a checkpoint" * 10)
    elif setup == "exists":
        dst.mkdir()
    elif setup == "hostile":
        src = tmp_path / "h.pt"
        torch.save({"x": _Evil()}, src)
    elif setup == "missing":
        src = tmp_path / "nope.pt"
    assert main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dcpstudio: error:") and expected in err
    assert "Traceback" not in err


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("payload",))


def test_bad_regex_is_a_usage_error(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(rich_pt), str(tmp_path / "o"), "--include", "("]) == 2
    assert "invalid name pattern" in capsys.readouterr().err


def test_entry_point_runs_as_a_program(rich_pt: Path, tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "dcpstudio", "torch_to_dcp", str(rich_pt), str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "dcpstudio", "convert", str(tmp_path / "missing"), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("dcpstudio: error:") and "Traceback" not in bad.stderr


def test_demo_writes_and_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "identical" in out and (tmp_path / "demo_dcp" / ".metadata").is_file()


class _Tty:
    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_progress_bar_on_a_terminal() -> None:
    from dcpstudio.cli import TerminalProgress
    from dcpstudio.core import Progress

    tty = _Tty()
    bar = TerminalProgress(tty, interval=0.0)  # type: ignore[arg-type]
    bar(Progress(512 << 20, 1 << 30, 3, 10, "model.layers.3.w"))
    bar(Progress(1 << 30, 1 << 30, 10, 10, "model.norm"))
    bar.close()
    assert " 50.0% 512.0 MiB/1.0 GiB" in tty.text and "100.0%" in tty.text and tty.text.endswith("\n")
