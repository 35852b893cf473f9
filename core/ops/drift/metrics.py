"""The sums one tensor contributes at one step, accumulated block by block, and the float64 path
that computes them for any dtype (float32, bfloat16 and float16 blocks take :mod:`.single`'s float32
path unless they hold a NaN or an Inf; :func:`merge` folds one block's sums into the step's).

A block of step k is compared with the same block of the previous step, of the step before that and
of the run's first step, here all converted to float64 (the reader keeps just those). Every sum is
float64 over sub-blocks of :data:`SUB` elements, which stay in cache: ``np.dot`` on them is one BLAS
call below the size (10,000) where OpenBLAS's ``ddot`` starts threads, which on a shared machine spin
while waiting for a core (measured here at load 8: 30x slower with them). Values
that are not finite are counted (NaN, Inf, the first one's index) and left out of the sums, so one
NaN does not hide how the rest moved; the NaN check costs nothing when ``‖x‖²`` of a sub-block is
finite (a NaN or Inf anywhere makes it so).

A fixed sample of :data:`SAMPLE` elements (every ``numel // SAMPLE``-th, the same positions at every
step) is kept per tensor and step: distances between any two steps are estimated from it, which is
what finding a tensor that went back to an earlier step's values needs (see :mod:`.anomalies`).
Adam's ``exp_avg_sq`` (never negative) gets a histogram of its values, 16 bins per power of two,
so its percentiles are known within 3.2 % in bounded memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "SAMPLE",
    "SUB",
    "Other",
    "StepSums",
    "accumulate",
    "as_float64",
    "histogram",
    "merge",
    "new_histogram",
    "percentiles",
    "sample_range",
    "wants_histogram",
]

SUB = 1 << 13
SAMPLE = 128
_OCTAVE = 16  # histogram bins per power of two
_EXP_LO, _EXP_HI = -1100, 1030  # float64 exponents (frexp), subnormals included
_BINS = (_EXP_HI - _EXP_LO) * _OCTAVE


def wants_histogram(name: str) -> bool:
    """Optimizer second moments: their spread (percentiles) is what tells a dying or exploding
    layer, and they are never negative, so a log histogram holds them."""
    return name.endswith("exp_avg_sq")


@dataclass
class StepSums:
    """One tensor at one step. ``*_prev`` compare with the previous step of the run, ``*_back2`` with
    the one before it, ``dot_first`` with the run's first step (None when that step does not hold the
    tensor in the same shape). Indices are flat, row-major, into the tensor's elements."""

    count: int = 0
    norm2: float = 0.0
    nan: int = 0
    inf: int = 0
    first_bad: int | None = None
    dot_prev: float | None = None
    diff2_prev: float | None = None
    max_prev: float | None = None
    max_prev_at: int | None = None
    back2_at_max: float | None = None  # |W - W_back2| at the element of max_prev
    dot_first: float | None = None
    first: int | None = None  # the index of the step dot_first is with
    vmax: float = -math.inf
    sample: Any = field(default_factory=list)  # floats while accumulated, then a float32 array (:meth:`finish`)
    value: float | None = None  # a one-element tensor's value
    p50: float | None = None  # percentiles of the values, for optimizer second moments
    p99: float | None = None
    hist: Any = None  # while accumulated: numpy int64 counts over log2 bins, zeros in the last slot

    def start(self, prev: bool, first: bool) -> None:
        if prev:
            self.dot_prev, self.diff2_prev, self.max_prev = 0.0, 0.0, 0.0
        if first:
            self.dot_first = 0.0

    def finish(self) -> None:
        """Once every block is in: the sample as a compact array and the histogram as percentiles,
        so what is kept per tensor and step is about half a kilobyte, however long the run."""
        self.sample = np.asarray(self.sample, dtype=np.float32)
        if self.hist is not None:
            self.p50, self.p99 = percentiles(self.hist, (0.5, 0.99))
            self.hist = None

    def json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "hist"}
        out["sample"] = np.asarray(self.sample, dtype=np.float32).tolist()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepSums:
        out = cls(**data)
        out.sample = np.asarray(out.sample, dtype=np.float32)
        return out


def as_float64(t: torch.Tensor) -> np.ndarray:
    """A block's values as a flat float64 array: through numpy without torch arithmetic for the
    plain dtypes (bfloat16 as its bits shifted into a float32), through torch for the rest
    (float8, complex as real pairs)."""
    import torch

    from ...pickles.tensor_io import numeric

    flat = t.reshape(-1)
    if flat.dtype == torch.bfloat16:
        bits = flat.view(torch.int16).numpy().view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if flat.dtype in (
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    ):
        return flat.numpy().astype(np.float64)
    if flat.dtype.is_complex:
        return torch.view_as_real(flat).reshape(-1).to(torch.float64).numpy()
    return numeric(flat).reshape(-1).to(torch.float64).numpy()


def _note_bad(acc: StepSums, x: np.ndarray, start: int) -> np.ndarray:
    """Counts ``x``'s NaN and Inf into ``acc``; returns the mask of its finite values."""
    finite = np.isfinite(x)
    bad = np.flatnonzero(~finite)
    nans = int(np.count_nonzero(np.isnan(x[bad])))
    acc.nan += nans
    acc.inf += len(bad) - nans
    if acc.first_bad is None:
        acc.first_bad = start + int(bad[0])
    return finite


def _both_finite(other: Other, s: int, xs: np.ndarray, keep: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The sub-block at ``s`` of an earlier step's block, and ``xs``, both with zeros where either is
    not finite (only computed when one of them holds a NaN or an Inf)."""
    ps = other[0][s : s + len(xs)]
    if keep is None and not other[1]:
        return ps, xs
    both = np.isfinite(ps) if keep is None else np.isfinite(ps) & keep
    return np.where(both, ps, 0.0), np.where(both, xs, 0.0)


Other = tuple[np.ndarray, bool]  # an earlier step's block (flat float64) and whether it holds NaN or Inf


def accumulate(
    acc: StepSums,
    x: np.ndarray,
    start: int,
    numel: int,
    prev: Other | None,
    back2: Other | None,
    first: Other | None,
) -> bool:
    """Adds block ``x`` (flat float64, elements ``start..start+len(x)`` of a tensor of ``numel``)
    to ``acc``, comparing it with the same block of the previous step, of the one before, and of
    the first step (each None when not compared). Returns whether ``x`` holds a NaN or an Inf.
    Differences and products take the elements finite in both blocks."""
    acc.count += len(x)
    bad_before = acc.nan + acc.inf
    scratch = np.empty(min(SUB, len(x)), dtype=np.float64)
    for s in range(0, len(x), SUB):
        xs = x[s : s + SUB]
        d = scratch[: len(xs)]
        xx = float(np.dot(xs, xs))
        keep: np.ndarray | None = None
        if not math.isfinite(xx):
            keep = _note_bad(acc, xs, start + s)
            xs = np.where(keep, xs, 0.0)
            xx = float(np.dot(xs, xs))
        acc.norm2 += xx
        if first is not None:
            fs, xo = _both_finite(first, s, xs, keep)
            acc.dot_first = (acc.dot_first or 0.0) + float(np.dot(xo, fs))
        if prev is not None:
            ps, xo = _both_finite(prev, s, xs, keep)
            acc.dot_prev = (acc.dot_prev or 0.0) + float(np.dot(xo, ps))
            np.subtract(xo, ps, out=d)
            np.abs(d, out=d)
            m = float(d.max())
            acc.diff2_prev = (acc.diff2_prev or 0.0) + float(np.dot(d, d))
            if acc.max_prev is None or m > acc.max_prev or acc.max_prev_at is None:
                at = int(np.argmax(d))
                acc.max_prev, acc.max_prev_at = m, start + s + at
                if back2 is not None:  # where this step moved most: how far from two steps back
                    acc.back2_at_max = abs(float(xo[at]) - float(back2[0][s + at]))
    if numel == 1 and len(x) == 1:
        acc.value = float(x[0])
    if acc.hist is not None:
        good = x[np.isfinite(x)] if acc.nan + acc.inf > bad_before else x
        if len(good):
            acc.vmax = max(acc.vmax, float(good.max()))
        histogram(acc, good)
    lo, hi, step = sample_range(start, len(x), numel)
    if lo < hi:
        acc.sample.extend(x[lo - start : hi - start : step].tolist())
    return acc.nan + acc.inf > bad_before


def sample_range(start: int, n: int, numel: int) -> tuple[int, int, int]:
    """The sampled flat indices among ``start..start+n`` of a tensor of ``numel``: ``range(lo, hi, step)``."""
    step = max(1, numel // SAMPLE)
    return -(-start // step) * step, min(start + n, step * SAMPLE), step


def merge(total: StepSums, part: StepSums) -> None:
    """Folds ``part`` -- the sums of the next block, in row-major order -- into ``total``: what
    :func:`accumulate` over both blocks one after the other gives (its largest change the first
    of the largest)."""
    total.count += part.count
    total.norm2 += part.norm2
    total.nan += part.nan
    total.inf += part.inf
    if total.first_bad is None:
        total.first_bad = part.first_bad
    if part.dot_prev is not None:
        total.dot_prev = (total.dot_prev or 0.0) + part.dot_prev
        total.diff2_prev = (total.diff2_prev or 0.0) + (part.diff2_prev or 0.0)
    if part.max_prev_at is not None and (
        total.max_prev_at is None or total.max_prev is None or (part.max_prev or 0.0) > total.max_prev
    ):
        total.max_prev, total.max_prev_at, total.back2_at_max = part.max_prev, part.max_prev_at, part.back2_at_max
    if part.dot_first is not None:
        total.dot_first = (total.dot_first or 0.0) + part.dot_first
    total.vmax = max(total.vmax, part.vmax)
    total.sample.extend(part.sample)
    if part.value is not None:
        total.value = part.value
    if part.hist is not None and total.hist is not None:
        total.hist += part.hist


def histogram(acc: StepSums, xs: np.ndarray) -> None:
    """Counts ``xs`` (finite, float32 or float64: the same bins) into ``acc.hist``."""
    mant, exp = np.frexp(np.abs(xs))
    zero = mant == 0
    bins = (np.clip(exp, _EXP_LO, _EXP_HI - 1) - _EXP_LO) * _OCTAVE + ((mant * 2 - 1) * _OCTAVE).astype(np.int64)
    bins[zero] = _BINS
    acc.hist += np.bincount(bins, minlength=_BINS + 1)


def new_histogram() -> np.ndarray:
    return np.zeros(_BINS + 1, dtype=np.int64)


def percentiles(hist: Any, qs: tuple[float, ...]) -> list[float | None]:
    """Values at quantiles ``qs`` (0..1) of the magnitudes a histogram counted: the middle of the
    bin the quantile falls in (within 3.2 % of the value), zeros as zeros."""
    total = int(hist.sum())
    if total == 0:
        return [None for _ in qs]
    cum = np.cumsum(np.concatenate((hist[_BINS:], hist[:_BINS])))  # zeros first: the smallest values
    out: list[float | None] = []
    for q in qs:
        k = int(np.searchsorted(cum, max(1, math.ceil(q * total)), side="left"))
        if k == 0:
            out.append(0.0)
            continue
        exp, sub = divmod(k - 1, _OCTAVE)
        out.append(math.ldexp((1 + (sub + 0.5) / _OCTAVE) / 2, exp + _EXP_LO))
    return out
