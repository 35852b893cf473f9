"""A run, not a checkpoint: how every tensor moved across the training steps of one run.

:mod:`.run` finds a run (a folder of step-numbered checkpoints, local or remote), :mod:`.stream`
reads it once -- tensor by tensor, block by block, each block across the steps in order, on two
threads, without torch where the bytes lie in place -- into the sums of :mod:`.metrics` (float32 on
cache-sized chunks for float32/bfloat16/float16, :mod:`.single`; float64 otherwise), :mod:`.report`
turns the sums into series per tensor and per module,
:mod:`.anomalies` flags spikes, frozen tensors, NaN/Inf, reverted steps and layout changes, and
:mod:`.cache` keeps each step's sums beside the index cache so an unchanged run re-opens at once, and
:mod:`.trainer_state` adds a Hugging Face Trainer step's scalars (step, epoch, learning rate, loss) to
the values table.

The API (what the command line and the window's Run view call, the latter from a worker thread)::

    run = detect_run("checkpoint/")            # Run | None: .steps (RunStep: step, name, location,
                                               # parts), .convention, .skipped
    report = drift(run, progress=cb, cancel=token)   # DriftReport
    report.steps                               # [int], ascending
    report.series[name][metric]                # a list aligned with report.steps (None: not there)
    report.groups[module][metric]              # the same per module (prefix of the dotted names)
    report.values[name]                        # non-tensor values (step, lr) and 0-d tensors per step,
                                               # trainer_state.json's (trainer_state.loss, ...)
    report.notes                               # [str]: what was read but not used, and why
    report.anomalies                           # [Anomaly(step, entry, kind, detail, chunk)]
    report.json(), report.csv(), report.text()

It opens checkpoints through :mod:`...checkpoints` and reads blocks through :mod:`...io`; it sits in
the top row of the operations, beside verify, demo and mappings, and nothing below imports it."""

from __future__ import annotations

from .anomalies import SPIKE, Finding, find_anomalies
from .compute import drift
from .report import METRICS, Anomaly, DriftReport
from .run import CONVENTIONS, Run, RunStep, detect_run

__all__ = [
    "CONVENTIONS",
    "METRICS",
    "SPIKE",
    "Anomaly",
    "DriftReport",
    "Finding",
    "Run",
    "RunStep",
    "detect_run",
    "drift",
    "find_anomalies",
]
