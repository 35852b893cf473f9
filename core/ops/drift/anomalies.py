"""Finding what went wrong in a run from its sums: each rule compares a tensor with itself (its own
median change) or with its siblings, never with a fixed scale, so it holds for any model and lr.

- ``spike``: a step whose change (relative L2, or the largest element change) is more than
  :data:`SPIKE` times the tensor's own median change. When the next step undoes it -- the element the
  next step moves most goes back to near its value of the step before -- the fault was
  in that one checkpoint (a flipped bit, a bad write): it is reported once, at the step that holds
  it, naming the element and chunk, and not again as the reversal.
- ``frozen``: unchanged (bitwise: ‖ΔW‖ = 0) while most of its siblings change -- the tensors of the
  same name in the other layers (``layers.*.attention.wq.weight``), or, for a tensor of which there is
  one, the tensors under the same root once it has itself changed before (so buffers that never
  change are not flagged). Reported once, at the first unchanged step.
- ``nonfinite``: NaN or Inf where the previous step had none, with the first one's element.
- ``reverted``: a step whose values equal an earlier, non-adjacent step's (by norm and the sampled
  values) or are far closer to one than to the previous step's while the change from the previous
  step is unusually large -- what resuming from the wrong checkpoint looks like. The distances are
  estimated from the fixed sample of :data:`~.metrics.SAMPLE` elements per step: no second read and
  no digest of every step (which would hash every byte: about as costly as reading it again on this
  machine's two cores, and the digest's algorithm is the integrity package's to change), at the price
  that "equal" and "far closer" are judged on the sample and the norm.
- ``layout``: an entry added or removed, or its kind, dtype or shape changed, between two steps.

Scalars (0-d or one-element tensors, such as Adam's ``step``) are values, not weights: they go to the
values table, not through these rules.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .metrics import StepSums

__all__ = ["SPIKE", "Finding", "find_anomalies"]

SPIKE = 10.0
"""How many times its median change a step's change must exceed to be a spike."""
_TRANSIENT = 4.0  # a change this many times the median, undone by the next step: a fault in one checkpoint
_UNDONE = 0.25  # the step after is back within this fraction of the change: the change was undone
_CLOSER = 0.5  # an earlier step at most half as far as the previous one: reverted to it
_LARGE = 2.0  # ... when the change from the previous step is this many times its median


@dataclass(frozen=True)
class Finding:
    """An anomaly at step index ``i`` (into the run's steps); ``at`` the flat element index when one
    element shows it."""

    i: int
    entry: str
    kind: str
    detail: str
    at: int | None = None


Layout = Mapping[str, tuple[str, str, tuple[int, ...] | None]]  # name -> (kind, dtype, shape) at one step


def _template(name: str) -> str:
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", name)


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(got) if got else None


def _weights(sums: dict[str, list[StepSums | None]]) -> dict[str, list[StepSums | None]]:
    return {n: ss for n, ss in sums.items() if any(s is not None and s.count > 1 for s in ss)}


def find_anomalies(
    steps: Sequence[int],
    sums: dict[str, list[StepSums | None]],
    layouts: Sequence[Layout],
) -> list[Finding]:
    """Every finding of the run, ordered by step, then kind, then entry."""
    weights = _weights(sums)
    found: list[Finding] = []
    found += _layout(layouts)
    found += _nonfinite(weights)
    spikes = _spikes(steps, weights)
    found += spikes
    flagged = {(f.entry, f.i) for f in found if f.kind in ("spike", "nonfinite")}
    found += _frozen(steps, weights)
    found += _reverted(steps, weights, flagged)
    return sorted(found, key=lambda f: (f.i, f.kind, f.entry))


def _layout(layouts: Sequence[Layout]) -> list[Finding]:
    out = []
    for i in range(1, len(layouts)):
        before, now = layouts[i - 1], layouts[i]
        for name in now.keys() - before.keys():
            out.append(Finding(i, name, "layout", "added (not in the previous step)"))
        for name in before.keys() - now.keys():
            out.append(Finding(i, name, "layout", "removed (in the previous step)"))
        for name in now.keys() & before.keys():
            (k0, d0, s0), (k1, d1, s1) = before[name], now[name]
            if k0 != k1:
                out.append(Finding(i, name, "layout", f"a {k1} now, a {k0} before"))
            elif (d0, s0) != (d1, s1):
                what = [f"dtype {d0} -> {d1}"] if d0 != d1 else []
                what += [f"shape {list(s0 or ())} -> {list(s1 or ())}"] if s0 != s1 else []
                out.append(Finding(i, name, "layout", ", ".join(what)))
    return out


def _nonfinite(weights: dict[str, list[StepSums | None]]) -> list[Finding]:
    out = []
    for name, ss in weights.items():
        for i, s in enumerate(ss):
            before = ss[i - 1] if i else None
            if s is not None and s.nan + s.inf and (before is None or before.nan + before.inf == 0):
                out.append(
                    Finding(i, name, "nonfinite", f"{s.nan} NaN, {s.inf} Inf appear (of {s.count})", s.first_bad)
                )
    return out


def _rel(s: StepSums | None, prev: StepSums | None) -> float | None:
    if s is None or prev is None or s.diff2_prev is None or prev.norm2 <= 0:
        return None
    return math.sqrt(s.diff2_prev / prev.norm2)


_MOMENTS = re.compile(r"(?:^|\.)(?:exp_avg|exp_avg_sq|max_exp_avg_sq|momentum_buffer|square_avg|acc_delta|sum|mu|nu)$")


def _moment(name: str) -> bool:
    """An optimizer's running moment: early on it doubles from step to step (Adam's bias-correction
    era), so its own median is no scale for a spike; only a transient (:func:`_transient`) is."""
    return bool(_MOMENTS.search(name))


def _spikes(steps: Sequence[int], weights: dict[str, list[StepSums | None]]) -> list[Finding]:
    out = []
    for name, ss in weights.items():
        rel = [_rel(s, ss[i - 1] if i else None) for i, s in enumerate(ss)]
        big = [s.max_prev if s is not None else None for s in ss]
        m_rel, m_big = _median(rel), _median(big)
        hits: dict[int, str] = {}
        for i, s in enumerate(ss):
            if s is None:
                continue
            why = []
            r, b = rel[i], big[i]
            for what, v, m in (("‖ΔW‖/‖W‖", r, m_rel), ("max |ΔW|", b, m_big)):
                if v is not None and m and v > (_TRANSIENT if _transient(ss, i, m_rel, m_big) else SPIKE) * m:
                    why.append(f"{what} {v:.3g}, {v / m:.0f}x its median {m:.3g}")
            if why and (not _moment(name) or _transient(ss, i, m_rel, m_big)):
                hits[i] = "; ".join(why)
        for i in sorted(hits):
            if i - 1 in hits and _undone(ss, i):
                continue  # the reversal of the spike before: reported there
            s = ss[i]
            assert s is not None
            detail = hits[i]
            if i + 1 < len(ss) and _undone(ss, i + 1):
                detail += (
                    f"; undone at step {steps[i + 1]} (back to step {steps[i - 1]}'s values): this checkpoint alone"
                )
            out.append(Finding(i, name, "spike", detail, s.max_prev_at))
    return out


def _transient(ss: list[StepSums | None], i: int, m_rel: float | None, m_big: float | None) -> bool:
    """Whether step ``i`` changed by :data:`_TRANSIENT` times the median and step ``i + 1`` undid
    it (:func:`_undone`) -- a fault in checkpoint ``i`` alone, which healthy training never shows:
    its two-step changes are at least about its one-step ones."""
    if i + 1 >= len(ss) or not _undone(ss, i + 1):
        return False
    s, after = ss[i], ss[i + 1]
    assert after is not None
    if s is None or s.max_prev is None or after.max_prev is None:
        return False
    big = bool(m_big) and min(s.max_prev, after.max_prev) > _TRANSIENT * (m_big or 0.0)
    prev = ss[i - 1]
    rel = (
        bool(m_rel)
        and prev is not None
        and after.diff2_prev is not None
        and s.diff2_prev is not None
        and prev.norm2 > 0
        and min(s.diff2_prev, after.diff2_prev) > (_TRANSIENT * (m_rel or 0.0)) ** 2 * prev.norm2
    )
    return big or rel


def _undone(ss: list[StepSums | None], i: int) -> bool:
    """Whether step ``i``'s largest element change took that element back to within a fraction
    :data:`_UNDONE` of it of its value at step ``i - 2``: the change undid step ``i - 1``'s."""
    s = ss[i]
    if s is None or s.back2_at_max is None or not s.max_prev:
        return False
    return s.back2_at_max < _UNDONE * s.max_prev


def _frozen(steps: Sequence[int], weights: dict[str, list[StepSums | None]]) -> list[Finding]:
    templates: dict[str, list[str]] = {}
    roots: dict[str, list[str]] = {}
    for name in weights:
        templates.setdefault(_template(name), []).append(name)
        roots.setdefault(name.split(".", 1)[0], []).append(name)
    out = []
    for name, ss in weights.items():
        siblings = [n for n in templates[_template(name)] if n != name]
        alone = not siblings
        if alone:
            siblings = [n for n in roots[name.split(".", 1)[0]] if n != name]
        run_start: int | None = None
        changed_before = False
        for i, s in enumerate(ss):
            still = s is not None and s.diff2_prev == 0.0
            moving = [n for n in siblings if (t := weights[n][i]) is not None and t.diff2_prev is not None]
            changing = [n for n in moving if (weights[n][i].diff2_prev or 0.0) > 0]  # type: ignore[union-attr]
            frozen = still and len(changing) * 2 > len(moving) > 0 and (changed_before or not alone)
            if frozen and run_start is None:
                run_start = i
                label = _template(name) if not alone else f"{name.split('.', 1)[0]}.*"
                out.append(
                    Finding(
                        i,
                        name,
                        "frozen",
                        f"unchanged since step {steps[i - 1]} while {len(changing)} of {len(moving)} of {label} change",
                    )
                )
            elif not frozen:
                run_start = None
            if s is not None and (s.diff2_prev or 0.0) > 0:
                changed_before = True
    return out


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b))


def _nearest(ss: list[StepSums | None], i: int, exact: bool) -> tuple[float, int] | None:
    """The step before ``i - 1`` whose sample is nearest step ``i``'s (with ``exact``, only the
    steps of the very same norm are looked at: equal values have equal sums)."""
    s = ss[i]
    assert s is not None
    older = [
        j
        for j in range(i - 1)
        if (t := ss[j]) is not None and t.sample.shape == s.sample.shape and (not exact or t.norm2 == s.norm2)
    ]
    if not older:
        return None
    here = s.sample.astype(np.float64)
    dist = np.linalg.norm(np.stack([ss[j].sample for j in older]) - here, axis=1)  # type: ignore[union-attr]
    k = int(np.argmin(dist))
    return float(dist[k]), older[k]


def _reverted(
    steps: Sequence[int], weights: dict[str, list[StepSums | None]], flagged: set[tuple[str, int]]
) -> list[Finding]:
    """Distances between samples are computed only for the steps that could qualify: to steps of the
    same norm (equal values), and to all earlier steps where the change is unusually large -- so a run
    of many steps costs a pass over its steps, not over all their pairs."""
    out = []
    for name, ss in weights.items():
        d_prev: list[float | None] = [None] * len(ss)
        for i in range(1, len(ss)):
            s, p = ss[i], ss[i - 1]
            if s is not None and p is not None and s.diff2_prev is not None and s.sample.shape == p.sample.shape:
                d_prev[i] = _distance(s.sample, p.sample)
        typical = _median(d_prev)
        for i in range(2, len(ss)):
            s, dp = ss[i], d_prev[i]
            if s is None or dp is None or not s.diff2_prev:
                continue
            large = bool(typical) and dp > _LARGE * (typical or 0.0)
            found = _nearest(ss, i, exact=not large)
            if found is None:
                continue
            d, j = found
            if j == i - 2 and (name, i - 1) in flagged:
                continue  # undoing the fault of step i - 1, reported there
            older = ss[j]
            assert older is not None
            if d == 0.0 and older.norm2 == s.norm2:
                detail = f"equal to step {steps[j]}'s values (norm and sampled values), not step {steps[i - 1]}'s"
                out.append(Finding(i, name, "reverted", detail))
            elif large and d < _CLOSER * dp:
                detail = (
                    f"{dp / max(d, 1e-300):.3g}x closer to step {steps[j]}'s values than to step "
                    f"{steps[i - 1]}'s (sampled)"
                )
                out.append(Finding(i, name, "reverted", detail))
    return out
