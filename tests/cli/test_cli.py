"""The ``dcpstudio`` command: exit codes, one-line errors, format_utils-compatible subcommands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main
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
    assert err.startswith("dcpstudio: error:") and "not a DCP checkpoint directory (it is a torch.save file)" in err


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
    from dcpstudio.cli.main import TerminalProgress
    from dcpstudio.core import Progress

    tty = _Tty()
    bar = TerminalProgress(tty, interval=0.0)  # type: ignore[arg-type]
    bar(Progress(512 << 20, 1 << 30, 3, 10, "model.layers.3.w"))
    bar(Progress(1 << 30, 1 << 30, 10, 10, "model.norm"))
    bar.close()
    assert " 50.0% 512.0 MiB/1.0 GiB" in tty.text and "100.0%" in tty.text and tty.text.endswith("\n")


def test_inspect_text_and_json(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["inspect", str(rich_pt)]) == 0
    text = capsys.readouterr().out
    assert "rich.pt (torch): 20 tensors" in text and "bf16  bfloat16 [5, 3]" in text
    assert "totals by dtype:" in text
    assert main(["convert", str(rich_pt), str(tmp_path / "d"), "-q"]) == 0
    assert main(["inspect", str(tmp_path / "d"), "--json", "--chunks"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "dcp" and doc["schema"] == 1
    w = next(e for e in doc["entries"] if e["fqn"] == "model.w")
    assert w["kind"] == "tensor" and w["dtype"] == "float32" and w["shape"] == [6, 8] and w["nbytes"] == 192
    (chunk,) = w["chunks"]
    assert chunk["file"] == "__0_0.distcp" and chunk["offsets"] == [0, 0] and chunk["data_offset"] > chunk["offset"]
    with open(tmp_path / "d" / chunk["file"], "rb") as f:
        f.seek(chunk["data_offset"])
        got = torch.frombuffer(bytearray(f.read(192)), dtype=torch.float32).reshape(6, 8)
    assert torch.equal(got, rich_state_dict()["model"]["w"])
    step = next(e for e in doc["entries"] if e["fqn"] == "step")
    assert step["kind"] == "bytes" and step["dtype"] is None


def test_verify_exit_codes(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["convert", str(rich_pt), str(tmp_path / "d"), "-q"]) == 0
    assert main(["verify", str(rich_pt), str(tmp_path / "d"), "-q"]) == 0
    assert "equal" in capsys.readouterr().out
    sd = rich_state_dict()
    sd["model"]["w"] = sd["model"]["w"] + 1e-3
    torch.save(sd, tmp_path / "changed.pt")
    assert main(["verify", str(tmp_path / "changed.pt"), str(tmp_path / "d"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["equal"] and [v["fqn"] for v in report["values"]] == ["model.w"]
    assert main(["verify", str(tmp_path / "changed.pt"), str(tmp_path / "d"), "--atol", "0.01", "-q"]) == 0
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "missing.pt"), str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.startswith("dcpstudio: error:")


def test_convert_to_safetensors_with_shards(rich_pt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "st"
    args = ["convert", str(rich_pt), str(out), "--to", "safetensors", "--max-shard-size", "200B", "--dtype", "bf16"]
    assert main([*args, "--strip-prefix", "model.", "--include", r"^model\.", "-q"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert main(["verify", str(out), str(out / "model.safetensors.index.json"), "-q"]) == 0
    capsys.readouterr()
    assert main(["convert", str(rich_pt), str(tmp_path / "x"), "--to", "safetensors", "--max-shard-size", "lots"]) == 2
    assert "invalid size" in capsys.readouterr().err


def test_load_command(rich_pt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", str(rich_pt), "--ranks", "2", "--layout", "fsdp"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["rank", "load", "time"] and len(out) == 3
    assert all("ok (" in line for line in out[1:])
    assert main(["load", str(rich_pt), "--ranks", "3", "--mesh", "2x2"]) == 2
    assert "needs 4 ranks" in capsys.readouterr().err


def test_load_reads_locally_or_streams_on_request(rich_pt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On one host the ranks read their own regions; --stream sends them every byte from rank 0."""
    for flags, streamed in (([], False), (["--stream"], True)):
        assert main(["load", str(rich_pt), "--ranks", "2", "--json", *flags]) == 0
        reports = json.loads(capsys.readouterr().out)
        reports = reports["ranks"] if isinstance(reports, dict) else reports
        assert all(r["ok"] for r in reports)
        assert (reports[1]["bytes_received"] > 0) == streamed
        assert reports[0]["bytes_sent"] == reports[1]["bytes_received"]


def test_window_without_a_display_is_a_one_line_error(tmp_path: Path) -> None:
    env = {
        k: v for k, v in __import__("os").environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")
    }
    out = subprocess.run(
        [sys.executable, "-m", "dcpstudio", "--demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "XDG_DATA_HOME": str(tmp_path)},
    )
    assert out.returncode == 1 and "no display" in out.stderr and "xvfb-run" in out.stderr
    assert "Traceback" not in out.stderr
