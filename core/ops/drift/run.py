"""A *run*: a folder whose children are checkpoints of one training run, each named with its step.

The conventions are the ones trainers write: torchtitan's ``step-1000`` (DCP folders), Hugging Face
Trainer's ``checkpoint-500`` (safetensors or torch.save weights, with ``optimizer.pt`` beside them),
Lightning's ``epoch=3-step=1200.ckpt``, Megatron's ``iter_0001000``, DeepSpeed's ``global_step300``
and plain numbered folders or files (``1000``, ``step_1000.pt``). ``pattern`` is a regular expression
for anything else, matched against a whole child name, whose group ``step`` (or first group) is the
step. The run's location may be a URL (object storage): children are listed through
:mod:`...io.remote`, as every reader lists them.

Detection reads no tensor: it lists the folder and detects each matching child's format. Children
that match but are not checkpoints yet (a save still in progress: ``.distcp`` files, no
``.metadata``) are left out and named in :attr:`Run.skipped`, never silently.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from ...errors import DCPStudioError
from ...formats.detect import Format, detect_format
from ...io.remote.locations import as_location

__all__ = ["CONVENTIONS", "Run", "RunStep", "detect_run"]

CONVENTIONS: dict[str, str] = {
    "torchtitan": r"step-(?P<step>\d+)",
    "hf-trainer": r"checkpoint-(?P<step>\d+)",
    "lightning": r"(?:.*-)?epoch=\d+-step=(?P<step>\d+)(?:-v\d+)?\.ckpt",
    "megatron": r"iter_(?P<step>\d+)",
    "deepspeed": r"global_step(?P<step>\d+)",
    "numbered": r"(?:step[_-]?)?(?P<step>\d+)(?:\.(?:pt|pth|bin|ckpt|safetensors))?",
}
"""Convention name -> the regular expression a child's whole name matches; ``step`` is the step."""

_HF_OPTIMIZER = "optimizer.pt"


@dataclass(frozen=True)
class RunStep:
    """One checkpoint of the run. ``parts``: the checkpoints read for this step, each with the
    prefix its entries get (a Hugging Face Trainer folder: its weights, and ``optimizer.pt`` under
    ``optimizer.``); one part with prefix ``""`` otherwise."""

    step: int
    name: str
    location: Any
    parts: tuple[tuple[str, Any, Format], ...]


@dataclass(frozen=True)
class Run:
    """The checkpoints of one run, ascending by step."""

    location: Any
    convention: str
    steps: tuple[RunStep, ...]
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (child name, why it is not a step)

    @property
    def step_numbers(self) -> list[int]:
        return [s.step for s in self.steps]


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--pattern {pattern!r} is not a regular expression: {e}") from None
    if "step" not in rx.groupindex and rx.groups < 1:
        raise ValueError(f"--pattern {pattern!r} has no group for the step: use (?P<step>\\d+) or (\\d+)")
    return rx


def _step_of(rx: re.Pattern[str], name: str) -> int | None:
    m = rx.fullmatch(name)
    if m is None:
        return None
    text = m.group("step") if "step" in rx.groupindex else m.group(1)
    return int(text) if text is not None and text.isdigit() else None


def _parts(child: Any, convention: str) -> tuple[tuple[str, Any, Format], ...]:
    """What is read for one step: the child as a checkpoint, plus a Hugging Face Trainer folder's
    optimizer state (a torch.save of ``Optimizer.state_dict()``) when it holds one."""
    fmt = detect_format(child)
    parts: list[tuple[str, Any, Format]] = [("", child, fmt)]
    optimizer = child / _HF_OPTIMIZER if fmt == "safetensors" and child.is_dir() else None
    if optimizer is not None and optimizer.is_file():
        parts.append(("optimizer.", optimizer, detect_format(optimizer)))
    return tuple(parts)


def detect_run(path: str | os.PathLike[str] | Any, pattern: str | None = None) -> Run | None:
    """The run in folder ``path``, or None when ``path`` is not a folder of step-numbered
    checkpoints (at least two of them) -- a checkpoint itself is not a run. With ``pattern`` only
    that convention is tried; otherwise the convention naming the most children wins.

    Two children with the same step are refused (:class:`DCPStudioError`): which one is the run's
    is not ours to guess."""
    where = as_location(path)
    if not where.is_dir():
        return None
    names = sorted(child.name for child in where.iterdir())
    candidates = {"pattern": _compile(pattern)} if pattern else {k: re.compile(v) for k, v in CONVENTIONS.items()}
    best: tuple[str, dict[int, list[str]]] | None = None
    for convention, rx in candidates.items():
        found: dict[int, list[str]] = {}
        for name in names:
            step = _step_of(rx, name)
            if step is not None:
                found.setdefault(step, []).append(name)
        if found and (best is None or len(found) > len(best[1])):
            best = (convention, found)
    if best is None:
        return None
    convention, found = best
    steps: list[RunStep] = []
    skipped: list[tuple[str, str]] = []
    for step in sorted(found):
        if len(found[step]) > 1:
            raise DCPStudioError(
                f"{where}: two checkpoints for step {step} ({', '.join(found[step])}); "
                "pass --pattern to choose one convention"
            )
        name = found[step][0]
        child = where / name
        try:
            steps.append(RunStep(step, name, child, _parts(child, convention)))
        except DCPStudioError as e:
            skipped.append((name, str(e).splitlines()[0]))
    if len(steps) < 2:
        return None
    return Run(where, convention, tuple(steps), tuple(skipped))
