"""A run in object storage opens as a run: its step folders listed through the remote layer, each
checkpoint read once by range, the same report as the local copy; cached by the objects' ETags."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

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


def test_a_trainer_run_in_s3_has_its_trainer_state(
    training_runs: dict[str, Any], s3: Any, bucket: str, tmp_path: Path
) -> None:
    """A Hugging Face Trainer run in object storage: each step's trainer_state.json read by the remote
    layer gives the values the local copy gives."""
    if training_runs["healthy"] is None:
        pytest.skip("safetensors is not installed")
    local = tmp_path / "hf"
    for step in (1, 2):
        (local / f"checkpoint-{step}").mkdir(parents=True)
        for name in ("model.safetensors", "trainer_state.json"):
            shutil.copy(training_runs["healthy"] / f"checkpoint-{step}" / name, local / f"checkpoint-{step}")
    s3.put(str(local), f"{bucket}/hf", recursive=True)
    remote = drift(detect_run(f"s3://{bucket}/hf"), cache=False)
    mine = drift(detect_run(local), cache=False)
    assert remote.values == mine.values and remote.values["trainer_state.global_step"] == [1, 2]
    assert remote.notes == [] and remote.values["trainer_state.loss"][1] is not None
