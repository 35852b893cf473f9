"""A run in object storage opens as a run: its step folders listed through the remote layer, each
checkpoint read once by range, the same report as the local copy; cached by the objects' ETags."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dcpstudio.core.ops.drift import detect_run, drift


def test_a_run_in_s3_is_the_run(training_runs: dict[str, Any], s3: Any, bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "run"
    for step in (1, 2, 3, 4):  # four steps: every rule has a step before and two back
        shutil.copytree(training_runs["faulty"] / f"step-{step}", local / f"step-{step}")
    s3.put(str(local), f"{bucket}/run", recursive=True)
    run = detect_run(f"s3://{bucket}/run")
    assert run is not None and run.convention == "torchtitan" and run.step_numbers == [1, 2, 3, 4]
    remote = drift(run)
    mine = drift(detect_run(local), cache=False)
    assert remote.cached_steps == 0
    got, want = remote.json(), mine.json()
    assert got.pop("location") == f"s3://{bucket}/run" and want.pop("location") == str(local)
    assert got == want and {(a["step"], a["kind"]) for a in got["anomalies"]} == {(4, "frozen")}
    again = drift(run)
    assert again.cached_steps == 4 and again.read_bytes == 0
