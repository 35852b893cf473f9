"""``inspect`` says the same of the same content whatever the format: a small plain value's repr,
"value" for non-tensor entries in the totals, plurals that agree with their counts."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main
from tests.conftest import dcp_save


def _lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
def test_values_and_totals_read_alike_in_every_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"model": {"w": torch.ones(2, 2)}, "step": 1234, "cfg": {"lr": 0.1}}, tmp_path / "m.pt")
    assert main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "m_dcp"), "-q"]) == 0
    assert main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "m.safetensors"), "-q"]) == 0
    listings = {}
    for name in ("m.pt", "m_dcp", "m.safetensors"):
        lines = _lines(["inspect", str(tmp_path / name)], capsys)
        assert lines[0].endswith(": 1 tensor, 2 other values, 16 B"), lines[0]
        assert "  step  = 1234" in lines and "    lr  = 0.1" in lines, lines
        by_dtype = lines[lines.index("totals by dtype:") + 1 : lines.index("totals by prefix:")]
        listings[name] = sorted(line.split()[0] for line in by_dtype)
    assert listings["m.pt"] == listings["m_dcp"] == listings["m.safetensors"] == ["float32", "value"]
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "one.pt"), "--include", "step"]) == 0
    assert ": 0 tensors, 1 other value, 0 B in" in capsys.readouterr().out


def test_dcp_values_not_shown_say_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp_save(
        {"w": torch.ones(2), "when": datetime.date(2026, 12, 1), "big": list(range(100_000))},
        checkpoint_id=str(tmp_path / "d"),
    )
    lines = _lines(["inspect", str(tmp_path / "d")], capsys)
    assert any(line.startswith("  when  (value, ") and "not shown: needs --trust-pickle" in line for line in lines)
    assert any(line.startswith("  big  (value, ") and "KiB)" in line for line in lines), lines
    trusted = _lines(["inspect", str(tmp_path / "d"), "--trust-pickle"], capsys)
    assert "  when  = datetime.date(2026, 12, 1)" in trusted


def test_a_listing_reads_a_bounded_number_of_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dcpstudio.core.ops.report as report

    dcp_save({"w": torch.ones(2), "a": 1, "b": 2, "c": 3}, checkpoint_id=str(tmp_path / "d"))
    monkeypatch.setitem(report._SHOWN_VALUES_READS, "local", 2)
    lines = _lines(["inspect", str(tmp_path / "d")], capsys)
    assert "  a  = 1" in lines and "  b  = 2" in lines
    assert any(line.startswith("  c  (value, ") for line in lines), lines
