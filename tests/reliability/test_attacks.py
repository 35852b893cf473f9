"""Crafted checkpoints of every class in attacks.py, through every command (inspect, convert to
each format, verify), each in a child process: nothing outside the checkpoint is read, nothing
crashes or hangs, peak RSS stays under 600 MiB, no output holds bytes that were not in the
checkpoint, every failure is one named line, and nothing is left behind."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import leftovers
from tests.reliability.attacks import ATTACKS, COMMANDS, Attack

ROOT = Path(__file__).resolve().parents[2]
RSS_LIMIT = 600 << 20
VARIANTS = 4  # seeds per attack class: each draws one of the class's variants
ONE_VARIANT = {"metadata-twice"}  # ~11 s each, and its seeds would differ by padding only
_RAW = ("\x1b", "\x07", "\x08", "\u202e")


def _run(attack: Attack, out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.attack_runner", str(attack.path), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"the process died ({proc.returncode}): {proc.stderr[-2000:]}"
    report: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def _outputs(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.is_file()]


@pytest.mark.parametrize(
    ("name", "seed"), [(n, s) for n in sorted(ATTACKS) for s in range(1 if n in ONE_VARIANT else VARIANTS)]
)
def test_crafted_checkpoint(name: str, seed: int, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    attack = ATTACKS[name](work, random.Random(seed))
    out = tmp_path / "out"
    out.mkdir()
    report = _run(attack, out)
    assert int(str(report["peak_rss"])) <= RSS_LIMIT, f"{attack.note}: peak RSS {report['peak_rss']}"
    for command in COMMANDS:
        r = report[command]
        assert isinstance(r, dict)
        where = f"{name} ({attack.note}) {command}"
        assert r["code"] in (0, 1, 2), f"{where}: {r['code']} {r['stderr']}"
        errors = [line for line in str(r["stderr"]).splitlines() if not line.startswith("dcpstudio: warning:")]
        assert len(errors) <= 1 and all(e.startswith("dcpstudio: error:") for e in errors), f"{where}: {errors}"
        assert "unexpected" not in str(r["stderr"]) and "Traceback" not in str(r["stderr"]), f"{where}: {errors}"
        if command in attack.must_fail:
            assert r["code"] != 0 and errors, f"{where} was not refused: {r['stdout'][:300]}"
        for stream in ("stdout", "stderr"):
            text = str(r[stream])
            assert not any(ch in text for ch in _RAW), f"{where}: raw control characters in {stream}"
            if attack.secret is not None:
                assert attack.secret.decode() not in text, f"{where}: foreign bytes in {stream}"
    if attack.secret is not None:
        for f in _outputs(out):
            assert attack.secret not in f.read_bytes(), f"{name} ({attack.note}): foreign bytes in {f.name}"
    assert leftovers(out) == []
