"""What a drift computation gives: series over steps per tensor and per module, the values table,
the anomalies -- and their JSON (read by checks outside this repository: keep its keys), CSV and text.

Per tensor and step (None where the step lacks the tensor or the metric does not apply):

- ``norm`` ‖W‖ (over the finite values), ``nan`` and ``inf`` counts;
- ``rel_change`` ‖W - W_prev‖ / ‖W_prev‖ and ``max_abs_change`` max |W - W_prev| against the
  previous step of the run (the same shape), ``cos_prev`` and ``cos_first`` the cosine similarity to
  the previous step and to the first step that holds the tensor in this shape;
- for Adam's ``exp_avg_sq``: ``p50``, ``p99`` (within 3.2 %) and ``max`` of its values.

A module's series (``groups``, one per prefix of the dotted names: ``model.layers.0``,
``model.layers.0.attention``) combine its tensors' sums: ``norm`` is the norm of all of them
together, ``rel_change`` and the cosines are those of the concatenated tensors.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from typing import Any

from .metrics import StepSums

__all__ = ["METRICS", "Anomaly", "DriftReport", "group_series", "tensor_series"]

METRICS = ("norm", "rel_change", "cos_prev", "cos_first", "max_abs_change", "nan", "inf")
_QUANTILES = ("p50", "p99")


@dataclass(frozen=True)
class Anomaly:
    """One finding: at ``step`` (the step number), tensor or value ``entry``, of ``kind``
    (``spike``, ``frozen``, ``nonfinite``, ``reverted``, ``layout``); ``chunk`` names the stored piece
    where it is (a DCP chunk with its file, or the file) when known."""

    step: int
    entry: str
    kind: str
    detail: str
    chunk: str | None = None

    def json(self) -> dict[str, Any]:
        return {"step": self.step, "entry": self.entry, "kind": self.kind, "detail": self.detail, "chunk": self.chunk}

    def line(self) -> str:
        return f"step {self.step}: {self.kind}: {self.entry}: {self.detail}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def _cos(dot: float | None, n2: float, m2: float | None) -> float | None:
    if dot is None or m2 is None or n2 <= 0 or m2 <= 0:
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(n2 * m2)))


def tensor_series(name: str, sums: list[StepSums | None]) -> dict[str, list[Any]]:
    """One tensor's metrics, aligned with the run's steps, from its sums at each step."""
    n = len(sums)
    out: dict[str, list[Any]] = {m: [None] * n for m in METRICS}
    hist = any(s is not None and s.p50 is not None for s in sums)
    if hist:
        out.update({q: [None] * n for q in (*_QUANTILES, "max")})
    for i, s in enumerate(sums):
        if s is None:
            continue
        prev = sums[i - 1] if i > 0 else None
        prev_n2 = prev.norm2 if prev is not None and s.dot_prev is not None else None
        first = sums[s.first] if s.first is not None else None
        first_norm2 = first.norm2 if first is not None else None
        out["norm"][i] = math.sqrt(s.norm2)
        out["nan"][i], out["inf"][i] = s.nan, s.inf
        if s.diff2_prev is not None and prev_n2 is not None:
            out["rel_change"][i] = _ratio(math.sqrt(s.diff2_prev), math.sqrt(prev_n2))
            out["max_abs_change"][i] = s.max_prev
            out["cos_prev"][i] = _cos(s.dot_prev, s.norm2, prev_n2)
        out["cos_first"][i] = (
            _cos(s.dot_first, s.norm2, first_norm2) if s.dot_first is not None else (1.0 if s.norm2 > 0 else None)
        )
        if hist and s.p50 is not None:
            out["p50"][i], out["p99"][i] = s.p50, s.p99
            out["max"][i] = s.vmax if s.count and math.isfinite(s.vmax) else None
    return out


def group_series(members: list[list[StepSums | None]]) -> dict[str, list[Any]]:
    """A module's metrics from its tensors' sums (each aligned with the steps)."""
    n = len(members[0]) if members else 0
    out: dict[str, list[Any]] = {m: [None] * n for m in METRICS}
    for i in range(n):
        here = [(s, m[i - 1] if i else None) for m in members if (s := m[i]) is not None]
        if not here:
            continue
        norm2 = sum(s.norm2 for s, _ in here)
        out["norm"][i] = math.sqrt(norm2)
        out["nan"][i] = sum(s.nan for s, _ in here)
        out["inf"][i] = sum(s.inf for s, _ in here)
        moved = [(s, p) for s, p in here if s.diff2_prev is not None and p is not None]
        if moved:
            n2, p2 = sum(s.norm2 for s, _ in moved), sum(p.norm2 for _, p in moved)
            out["rel_change"][i] = _ratio(math.sqrt(sum(s.diff2_prev or 0.0 for s, _ in moved)), math.sqrt(p2))
            out["max_abs_change"][i] = max(s.max_prev or 0.0 for s, _ in moved)
            out["cos_prev"][i] = _cos(sum(s.dot_prev or 0.0 for s, _ in moved), n2, p2)
    return out


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass
class DriftReport:
    """How every tensor of a run moved. ``series[name][metric]`` and ``groups[module][metric]`` are
    lists aligned with ``steps``; ``values[name]`` the non-tensor values (and 0-d tensors) per step."""

    location: str
    convention: str
    steps: list[int]
    series: dict[str, dict[str, list[Any]]]
    groups: dict[str, dict[str, list[Any]]]
    values: dict[str, list[Any]]
    anomalies: list[Anomaly]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was read but not used, and why (a bad trainer_state.json)
    cached_steps: int = 0  # steps whose sums came from the cache
    read_bytes: int = 0

    def json(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "convention": self.convention,
            "steps": self.steps,
            "series": {n: {m: [_clean(v) for v in vs] for m, vs in ms.items()} for n, ms in self.series.items()},
            "groups": {n: {m: [_clean(v) for v in vs] for m, vs in ms.items()} for n, ms in self.groups.items()},
            "values": {n: [_clean(v) for v in vs] for n, vs in self.values.items()},
            "anomalies": [a.json() for a in self.anomalies],
            "skipped": [{"name": n, "why": w} for n, w in self.skipped],
            "notes": list(self.notes),
        }

    def csv(self) -> str:
        """One row per step and entry: ``step, entry, <every metric>`` (empty where none), then the
        values table's entries as rows with a ``value`` column."""
        metrics = list(dict.fromkeys(m for ms in self.series.values() for m in ms))
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["step", "entry", *metrics, "value"])
        for i, step in enumerate(self.steps):
            for name, ms in self.series.items():
                row = [ms[m][i] if m in ms else None for m in metrics]
                if any(v is not None for v in row):
                    w.writerow(
                        [step, name, *("" if v is None else repr(v) if isinstance(v, float) else v for v in row), ""]
                    )
            for name, vs in self.values.items():
                if vs[i] is not None:
                    w.writerow([step, name, *([""] * len(metrics)), vs[i]])
        return buf.getvalue()

    def text(self) -> str:
        lines = [
            f"{self.location}: a run of {len(self.steps)} checkpoints ({self.convention}), steps "
            f"{self.steps[0]}..{self.steps[-1]}, {len(self.series)} tensors"
        ]
        lines += [f"  not a step yet: {name}: {why}" for name, why in self.skipped]
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(f"{len(self.anomalies)} anomal{'y' if len(self.anomalies) == 1 else 'ies'}")
        lines += ["  " + a.line() for a in self.anomalies]
        return "\n".join(lines)
