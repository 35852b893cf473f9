"""A run, not a checkpoint: drift over real tiny training runs (tests/_runs.py), against torch's own
readers and a float64 torch computation of every series."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core.errors import DCPStudioError
from dcpstudio.core.ops.drift import detect_run, drift
from tests import _runs

LAYER1 = [
    f"layers.1.{n}"
    for n in (
        "attention_norm.weight",
        "attention_norm.bias",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "ffn_norm.weight",
        "ffn_norm.bias",
        "feed_forward.w1.weight",
        "feed_forward.w1.bias",
        "feed_forward.w2.weight",
        "feed_forward.w2.bias",
    )
]


@pytest.fixture(scope="module")
def faulty(training_runs: dict[str, Any]) -> Any:
    return drift(detect_run(training_runs["faulty"]), cache=False)


def _close(got: Any, want: Any, name: str, metric: str, step: int) -> None:
    where = f"{name} {metric} at step {step}"
    if want is None or (isinstance(want, float) and math.isnan(want)):
        assert got is None, f"{where}: {got} instead of nothing"
        return
    assert got is not None, f"{where}: missing"
    assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12 if metric.startswith("cos") else 0.0), (
        f"{where}: {got} != {want}"
    )


def _compare(report: Any, states: list[dict[str, torch.Tensor]]) -> int:
    checked = 0
    for name, want in _runs.reference(states).items():
        got = report.series[name]
        for metric, values in want.items():
            for i, v in enumerate(values):
                _close(got[metric][i], v, name, metric, report.steps[i])
                checked += 1
    return checked


def test_faults_found_where_they_are(faulty: Any, training_runs: dict[str, Any]) -> None:
    """The flipped bit at step 7 (once, not again at its reversal at 8, with the element and file),
    the layer frozen from step 4 (its parameters and their Adam moments, nothing else), the NaN from
    step 10, the tensor added at step 9 -- and nothing else in a run of real training."""
    assert faulty.steps == list(range(1, 13))
    found = {(a.step, a.entry, a.kind) for a in faulty.anomalies}
    frozen = {(4, f"model.{n}", "frozen") for n in LAYER1}
    frozen |= {(4, f"optimizer.state.{n}.{m}", "frozen") for n in LAYER1 for m in ("exp_avg", "exp_avg_sq")}
    flip = training_runs["flip"]
    expected = frozen | {
        (7, flip.entry, "spike"),
        (10, "model.output.weight", "nonfinite"),
        (9, "model.extra", "layout"),
    }
    assert found == expected, (found - expected, expected - found)
    (spike,) = [a for a in faulty.anomalies if a.kind == "spike"]
    assert spike.chunk == "element [20, 4]: chunk 3 of 4 (offsets [16, 0]), file __0_0.distcp"
    assert "undone at step 8" in spike.detail
    (nan,) = [a for a in faulty.anomalies if a.kind == "nonfinite"]
    assert nan.chunk == "element [0, 5]: chunk 1 of 4 (offsets [0, 0]), file __0_0.distcp"
    assert faulty.series["model.output.weight"]["nan"] == [0] * 9 + [1, 1, 1]


def test_series_equal_a_float64_reference(faulty: Any, training_runs: dict[str, Any]) -> None:
    """Every series of every tensor of the faulty run (NaN included: the finite values count)
    equals torch's float64 computation over the tensors dcp.load reads back, within 1e-6."""
    _, model, opt = training_runs["faulty_trained"][0]
    states = [_runs.load_titan_step(training_runs["faulty"] / f"step-{s}", model, opt) for s in faulty.steps]
    assert _compare(faulty, states) > 5000


def test_healthy_run_has_no_anomalies(training_runs: dict[str, Any]) -> None:
    """A Hugging Face Trainer run (safetensors weights, optimizer.pt moments) of healthy training:
    zero anomalies; its series equal the reference; exp_avg_sq's percentiles within a bin."""
    if training_runs["healthy"] is None:
        pytest.skip("safetensors is not installed")
    run = detect_run(training_runs["healthy"])
    assert run is not None and run.convention == "hf-trainer"
    report = drift(run, cache=False)
    assert report.anomalies == []
    states = [_runs.load_hf_step(training_runs["healthy"] / f"checkpoint-{s}") for s in report.steps]
    assert _compare(report, states) > 5000
    # trainer_state.json's scalars: logged every 2 steps, so an odd step has the step before's loss;
    # evaluated at 6 and 12, so eval_loss is there from step 6 on
    log = {e["step"]: e for e in training_runs["healthy_log"]}
    logged = [s if s % 2 == 0 else s - 1 for s in report.steps]
    assert report.values["trainer_state.global_step"] == report.steps
    assert report.values["trainer_state.epoch"] == [s / _runs.STEPS_PER_EPOCH for s in report.steps]
    assert report.values["trainer_state.loss"] == [log[k]["loss"] if k else None for k in logged]
    assert report.values["trainer_state.grad_norm"] == [log[k]["grad_norm"] if k else None for k in logged]
    assert report.values["trainer_state.learning_rate"] == [None] + [3e-3] * 11
    evaluated = [log[6]["loss"] + 0.25] * 6 + [log[12]["loss"] + 0.25]
    assert report.values["trainer_state.eval_loss"] == [None] * 5 + evaluated
    assert report.notes == []
    for name in [n for n in states[0] if n.endswith("exp_avg_sq")][:6]:
        for i, state in enumerate(states):
            t = state[name].to(torch.float64).reshape(-1)
            for q, key in ((0.5, "p50"), (0.99, "p99")):
                want = float(torch.sort(t).values[max(0, math.ceil(q * t.numel()) - 1)])
                assert report.series[name][key][i] == pytest.approx(want, rel=0.033), (name, key, i)
            assert report.series[name]["max"][i] == float(t.max())


def test_resume_from_the_wrong_checkpoint(training_runs: dict[str, Any]) -> None:
    """Step 9 resumed from step 3's state: its tensors are found reverted at step 9, and nowhere else."""
    report = drift(detect_run(training_runs["resumed"]), cache=False)
    reverted = [a for a in report.anomalies if a.kind == "reverted"]
    assert {a.step for a in report.anomalies} == {9}
    weights = [n for n in report.series if n.startswith("model.")]
    assert len([a for a in reverted if a.entry.startswith("model.")]) >= 0.8 * len(weights)
    to = collections.Counter(int(re.search(r"to step (\d+)'s", a.detail).group(1)) for a in reverted)  # type: ignore[union-attr]
    assert set(to) <= {1, 2, 3, 4, 5} and to.most_common(1)[0][0] in (3, 4), to  # W9 = W3 + one step


def test_read_once_and_cached(training_runs: dict[str, Any]) -> None:
    """Every tensor byte of every step is read once; a second run reads nothing; a changed step
    recomputes itself and the two steps that compare with it, nothing else."""
    run = detect_run(training_runs["resumed"])
    assert run is not None
    first = drift(run)
    from dcpstudio.core import open_checkpoint

    total = 0
    for step in run.steps:
        with open_checkpoint(step.location) as ckpt:
            total += ckpt.tensor_bytes
    assert first.read_bytes == total and first.cached_steps == 0
    again = drift(run)
    assert again.cached_steps == 12 and again.read_bytes == 0
    assert again.json() == first.json()
    data = next(p for p in sorted((training_runs["resumed"] / "step-10").iterdir()) if p.suffix == ".distcp")
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    third = drift(run)
    assert third.cached_steps == 9  # steps 10, 11, 12 compare with step 10
    assert third.json() == first.json()


def test_a_bad_trainer_state_is_a_note(
    training_runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer_state.json that is not JSON, too large, shaped otherwise or naming another step:
    the run is analysed, those steps' trainer values are left out (or kept, for another global_step)
    and a note says which file and why -- in the report, its JSON and text, and on the CLI's stderr."""
    if training_runs["healthy"] is None:
        pytest.skip("safetensors is not installed")
    from dcpstudio.cli.main import main
    from dcpstudio.core.ops.drift.trainer_state import STATE_LIMIT

    states = {
        1: json.dumps({"global_step": 1, "log_history": [{"step": 1, "loss": 2.5}]}),
        2: '{"global_step": 2, "log_history": [',
        4: json.dumps({"global_step": 4, "log_history": {"step": 4}}),
        5: json.dumps({"global_step": 50, "epoch": 1.0}),
    }
    for step in range(1, 6):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        shutil.copy(training_runs["healthy"] / f"checkpoint-{step}" / "model.safetensors", folder)
        with open(folder / "trainer_state.json", "w") as f:
            if step == 3:
                f.truncate(2 * STATE_LIMIT)  # sparse: too large, never read
            else:
                f.write(states[step])
    report = drift(detect_run(tmp_path))
    again = drift(detect_run(tmp_path))  # the sums cached; trainer_state.json read again, its notes too
    assert again.cached_steps == 5 and (again.values, again.notes) == (report.values, report.notes)
    assert report.values["trainer_state.global_step"] == [1, None, None, None, 50]
    assert report.values["trainer_state.loss"] == [2.5, None, None, None, None]
    assert report.values["trainer_state.epoch"] == [None, None, None, None, 1.0]
    notes = report.notes
    assert len(notes) == 4 and [n.split("/")[0] for n in notes] == [f"checkpoint-{k}" for k in (2, 3, 4, 5)]
    assert notes[0].startswith("checkpoint-2/trainer_state.json: not JSON (") and "left out" in notes[0]
    assert notes[1].startswith("checkpoint-3/trainer_state.json: 32.0 MiB, more than the 16.0 MiB"), notes[1]
    assert "log_history is not a list" in notes[2]
    assert notes[3] == "checkpoint-5/trainer_state.json: global_step 50, not the step 5 its folder is named for"
    assert report.json()["notes"] == notes and f"note: {notes[0]}" in report.text()
    assert main(["drift", str(tmp_path), "-q", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["notes"] == notes and err.splitlines() == [f"dcpstudio: warning: {n}" for n in notes]


def _torch_file(path: Path, value: float) -> None:
    torch.save({"w": torch.full((3,), value)}, path)


def test_detect_conventions(tmp_path: Path) -> None:
    """Lightning's epoch=E-step=S.ckpt files, plain numbers, --pattern; not a run: a checkpoint
    itself, one step, a folder of other things; two checkpoints for one step refused."""
    light = tmp_path / "light"
    light.mkdir()
    for e, s in ((0, 100), (1, 200), (2, 300)):
        _torch_file(light / f"epoch={e}-step={s}.ckpt", float(s))
    (light / "last.ckpt").write_bytes((light / "epoch=2-step=300.ckpt").read_bytes())
    run = detect_run(light)
    assert run is not None and run.convention == "lightning" and run.step_numbers == [100, 200, 300]
    assert drift(run, cache=False).series["w"]["norm"] == pytest.approx([100 * 3**0.5, 200 * 3**0.5, 300 * 3**0.5])
    mine = tmp_path / "mine"
    mine.mkdir()
    for s in (5, 10, 15):
        _torch_file(mine / f"weights_at_{s}.bin", float(s))
    assert detect_run(mine) is None
    run = detect_run(mine, pattern=r"weights_at_(\d+)\.bin")
    assert run is not None and run.step_numbers == [5, 10, 15] and run.convention == "pattern"
    assert detect_run(mine / "weights_at_5.bin") is None
    plain = tmp_path / "plain"
    plain.mkdir()
    for s in (2, 1):
        _torch_file(plain / f"{s}.pt", float(s))
    (plain / "3").mkdir()
    (plain / "3" / "__0_0.distcp").write_bytes(b"half written")
    run = detect_run(plain)
    assert run is not None and run.step_numbers == [1, 2] and [n for n, _ in run.skipped] == ["3"]
    _torch_file(plain / "step_2.pt", 2.0)
    with pytest.raises(DCPStudioError, match="two checkpoints for step 2"):
        detect_run(plain)


def test_cancel_stores_nothing(training_runs: dict[str, Any], isolated_cache: Path) -> None:
    """Cancelled from the progress callback (as the window's Esc does): CancelledError, and no step
    is cached from the half-done computation."""
    from dcpstudio.core.errors import CancelledError
    from dcpstudio.core.progress import CancelToken

    run = detect_run(training_runs["faulty"])
    token = CancelToken()
    seen: list[float] = []

    def progress(p: Any) -> None:
        seen.append(p.fraction)
        if p.done_bytes > 0:
            token.cancel()

    with pytest.raises(CancelledError):
        drift(run, progress=progress, cancel=token)
    assert seen and max(seen) < 1.0
    stored = [f.read_bytes() for f in isolated_cache.rglob("*") if f.is_file()]
    assert not [b for b in stored if b"drift sums" in b]


def test_layout_and_frozen_rules_on_sums() -> None:
    """The rules alone, on sums: a dtype and a shape change and a removed entry between two steps;
    a tensor of which there is one that stops changing while the rest of its root moves (frozen,
    once, at the first unchanged step) -- and a buffer that never changed is not frozen."""
    from dcpstudio.core.ops.drift import find_anomalies
    from dcpstudio.core.ops.drift.metrics import StepSums

    def moving(i: int, change: float) -> StepSums:
        s = StepSums(count=10, norm2=1.0)
        if i:
            s.diff2_prev, s.dot_prev, s.max_prev, s.max_prev_at = change, 1.0, change, 0
        s.sample = [float(i), change]
        s.finish()
        return s

    n = 6
    sums = {
        "model.head": [moving(i, 0.0 if i >= 3 else 0.01) for i in range(n)],
        "model.buffer": [moving(i, 0.0) for i in range(n)],
        **{f"model.w{k}": [moving(i, 0.01 * (1 + 0.1 * ((i + k) % 3))) for i in range(n)] for k in range(4)},
    }
    layouts = [{"a": ("tensor", "float32", (4, 4)), "b": ("tensor", "float32", (4,)), "c": ("object", "", None)}
               for _ in range(n)]  # fmt: skip
    layouts[4] = {"a": ("tensor", "bfloat16", (4, 4)), "b": ("tensor", "float32", (5,))}
    found = {(f.i, f.entry, f.kind, f.detail) for f in find_anomalies(list(range(n)), sums, layouts)}
    assert {(i, e, k) for i, e, k, _ in found} == {
        (3, "model.head", "frozen"), (4, "a", "layout"), (4, "b", "layout"), (4, "c", "layout"),
        (5, "a", "layout"), (5, "b", "layout"), (5, "c", "layout"),
    }  # fmt: skip
    details = {(i, e): d for i, e, _, d in found}
    assert details[4, "a"] == "dtype float32 -> bfloat16" and details[4, "b"] == "shape [4] -> [5]"
    assert details[4, "c"] == "removed (in the previous step)" and details[5, "c"] == "added (not in the previous step)"


def test_a_tensors_first_step_is_a_dependency(training_runs: dict[str, Any]) -> None:
    """model.extra first appears at step 9: a changed step 9 recomputes 9, 10, 11 (the steps after)
    and 12 too (its cosine to the first is to step 9's model.extra)."""
    run = detect_run(training_runs["faulty"])
    assert drift(run).cached_steps == 0
    data = next(p for p in sorted((training_runs["faulty"] / "step-9").iterdir()) if p.suffix == ".distcp")
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert drift(run).cached_steps == 8


def test_large_blocks_equal_a_float64_reference(tmp_path: Path) -> None:
    """Tensors of many blocks and chunks, as float32 and bfloat16 (summed in float32 on rows) and
    float64 (in float64): within 1e-6 of the float64 reference -- a tensor drifting slowly (cos ~ 1),
    one whose later steps are nearly orthogonal to the first (cos ~ 0: the dot products in float64),
    one near 1 with small noise (float32 rounding biased), and a NaN appearing (that block in float64)."""
    g = torch.Generator().manual_seed(3)
    n = (1 << 19) + 4099  # a ragged last block, chunk and row
    base = torch.randn(n, generator=g, dtype=torch.float64) * 0.02
    other = torch.randn(n, generator=g, dtype=torch.float64) * 0.02
    states = []
    for k in range(4):
        drift_ = base + torch.randn(n, generator=g, dtype=torch.float64) * 1e-5 * (k + 1)
        turn = base * (1.0 if k == 0 else 0.01) + other * (0.0 if k == 0 else 1.0) * k
        near_one = 1 + torch.randn(n, generator=g, dtype=torch.float64) * 0.01
        nan = drift_.clone()
        if k >= 2:
            nan[n // 2 + 7] = float("nan")
        states.append({"w32": drift_.float(), "bf16": drift_.bfloat16(), "turn": turn.bfloat16(),
                       "ones": near_one.float(), "nan": nan.float(), "w64": turn})  # fmt: skip
    root = tmp_path / "run"
    root.mkdir()
    for k, state in enumerate(states):
        torch.save(state, root / f"step_{k + 1}.pt")
    report = drift(detect_run(root), cache=False, block_elements=1 << 17)
    assert report.series["nan"]["nan"] == [0, 0, 1, 1]
    assert {(a.step, a.entry, a.kind) for a in report.anomalies} == {(3, "nan", "nonfinite")}
    assert _compare(report, states) > 100


def test_threads_do_not_change_the_sums(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks summed on 1 thread or on 3 (a machine with more cores) merge to the same floats, bit
    for bit: blocks are merged in row-major order whoever summed them."""
    from dcpstudio.core.ops.drift import stream

    g = torch.Generator().manual_seed(5)
    w = torch.randn(3 * (1 << 15) + 77, generator=g)
    root = tmp_path / "run"
    root.mkdir()
    for k in range(3):
        w = w + torch.randn(w.shape, generator=g) * 1e-3
        torch.save({"w": w, "b": w[:1000].bfloat16()}, root / f"step_{k + 1}.pt")
    reports = []
    for threads in (1, 3):
        monkeypatch.setattr(stream, "THREADS", threads)
        reports.append(drift(detect_run(root), cache=False, block_elements=1 << 15).json())
    assert reports[0]["series"] == reports[1]["series"]
    assert reports[0]["series"]["w"]["rel_change"][1] > 0
