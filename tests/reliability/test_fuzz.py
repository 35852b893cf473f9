"""Mutated checkpoints (seeded): every case ends in success or a domain error -- never another
exception, a hang (10 s per case) or a memory blow-up (6 GiB address-space limit).

CI runs ``DCPSTUDIO_FUZZ_CASES`` cases per seed (default 2000, two seeds); set it higher for a
longer campaign.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = int(os.environ.get("DCPSTUDIO_FUZZ_CASES", "2000"))


@pytest.mark.parametrize("seed", [101, 202])
def test_mutated_inputs_end_in_success_or_a_domain_error(seed: int, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.reliability.fuzz_worker", str(seed), str(CASES), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["cases"] == CASES
    mutated = {k for k in summary["by_kind"] if not k.startswith("attack:")}
    assert mutated == {"torch_zip", "torch_legacy", "dcp_metadata", "dcp_data", "safetensors"}
    assert sum(v for k, v in summary["by_kind"].items() if k.startswith("attack:")) > CASES // 20
    assert summary["failures"] == [], summary["failures"][:5]
    assert summary["domain_errors"] > CASES // 2  # the mutations do break things
