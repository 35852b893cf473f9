"""Streaming statistics of one tensor: bounded memory whatever the tensor's size.

The tensor is read block by block (row-major boxes of at most ``budget`` bytes). Each block is
checked with one ``aminmax`` in its own dtype: when both ends are finite the block holds no NaN or
Inf and the masks are skipped (the common case). Moments are computed in float64 on sub-blocks
small enough to stay in cache (two-pass within the sub-block, merged with Chan's parallel
algorithm), so the result matches a float64 computation over the whole tensor without a float64
copy of it. The histogram needs the range first, so it is a second pass -- over the kept block when
the tensor fits in one, re-read otherwise; ``histc`` counts each sub-block in its own float type
(exact below 2**24 per bin) and the counts are summed as integers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...checkpoints.model import dtype_name, refuse_expanded
from ...checkpoints.opening import Checkpoint
from ...io.blocks import BLOCK_BUDGET, blocks, box_slices
from ...io.buffers import BufferPool
from ...progress import CancelToken, ProgressCallback, Reporter
from .histogram import HIST_BINS, add_counts, binnable, hist_edges, hist_range

if TYPE_CHECKING:
    import torch

__all__ = ["TensorStats", "tensor_stats"]

_SUB = 1 << 20  # elements per float64 sub-block (8 MiB): the copy stays in cache, counts stay exact
_FEW = 16  # non-finite values in a block up to which the finite runs between them are used as views


@dataclass(frozen=True)
class TensorStats:
    fqn: str
    dtype: str
    count: int
    finite: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    min: float
    max: float
    mean: float
    std: float  # population standard deviation of the finite values
    hist_edges: list[float] = field(default_factory=list)
    hist_counts: list[int] = field(default_factory=list)
    note: str = ""


@dataclass
class _Totals:
    count: int = 0
    finite: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    mean: float = 0.0
    m2: float = 0.0

    def merge(self, k: int, mean: float, m2: float) -> None:
        total = self.finite + k
        delta = mean - self.mean
        self.mean += delta * k / total
        self.m2 += m2 + delta * delta * self.finite * k / total
        self.finite = total


def _finite_part(x: torch.Tensor, acc: _Totals) -> list[torch.Tensor]:
    """Counts ``x``'s elements, NaNs and infinities into ``acc``; returns its finite values as
    pieces: ``[x]`` when all are finite, views between the few non-finite ones, or one masked copy
    when there are many."""
    import torch

    acc.count += x.numel()
    if x.numel() == 0:
        return []
    if not x.dtype.is_floating_point:
        return [x]
    lo, hi = (float(v) for v in torch.aminmax(x))
    if math.isfinite(lo) and math.isfinite(hi):
        acc.lo, acc.hi = min(acc.lo, lo), max(acc.hi, hi)  # the range of the one piece returned
        return [x]
    bad = torch.isfinite(x).logical_not_()
    where = torch.nonzero(bad).reshape(-1)
    odd = x[where]
    acc.nan += int(torch.count_nonzero(torch.isnan(odd)))
    acc.posinf += int(torch.count_nonzero(torch.isposinf(odd)))
    acc.neginf += int(torch.count_nonzero(torch.isneginf(odd)))
    if where.numel() > _FEW:
        good = x[bad.logical_not_()]
        return [good] if good.numel() else []
    edges = [-1, *where.tolist(), x.numel()]
    return [x[a + 1 : b] for a, b in itertools.pairwise(edges) if b > a + 1]


def _accumulate(good: torch.Tensor, acc: _Totals, ranged: bool) -> None:
    """Adds the finite values ``good`` to ``acc`` (their range too, unless ``ranged``: taken)."""
    import torch

    if not ranged:
        lo, hi = torch.aminmax(good)
        acc.lo, acc.hi = min(acc.lo, float(lo)), max(acc.hi, float(hi))
    acc.zeros += good.numel() - int(torch.count_nonzero(good))
    for start in range(0, good.numel(), _SUB):
        part = good[start : start + _SUB]
        d = part - 0.0 if part.dtype == torch.float64 else part.to(torch.float64)  # a fresh float64 copy
        k = d.numel()
        mean = float(d.sum()) / k
        d.sub_(mean)
        acc.merge(k, mean, float(torch.dot(d, d)))


def _read_blocks(ckpt: Checkpoint, fqn: str, budget: int, reporter: Reporter) -> Iterator[torch.Tensor]:
    """The tensor's blocks, flat, in row-major order. Each block's buffer is reused for a later one:
    the caller keeps nothing of a block (views included) once it asks for the next."""
    entry = ckpt.entry(fqn)
    assert entry.dtype is not None
    pool = BufferPool(keep=2)
    for offsets, sizes in blocks(entry.shape or (), entry.dtype.itemsize, budget):
        reporter.check()
        with pool.active():
            block = ckpt.read_tensor(fqn, box_slices(offsets, sizes))
        reporter.advance(block.numel() * block.element_size(), items=0, current=fqn)
        yield block
        pool.give(block)
        del block


def tensor_stats(
    ckpt: Checkpoint,
    fqn: str,
    *,
    bins: int = HIST_BINS,
    budget: int = BLOCK_BUDGET,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> TensorStats:
    """min, max, mean, std, NaN / Inf / zero counts and a histogram of one tensor, read in blocks
    of at most ``budget`` bytes. Complex tensors are summarised by magnitude."""
    import torch

    entry = ckpt.entry(fqn)
    if entry.kind != "tensor" or entry.dtype is None:
        raise ValueError(f"{fqn} is not a tensor")
    refuse_expanded(entry, str(ckpt.path), "summarise")
    one_block = entry.nbytes <= budget
    passes = 2 if bins > 0 and not one_block else 1
    reporter = Reporter(progress, cancel, total_bytes=entry.nbytes * passes, total_items=1)
    acc = _Totals()
    kept: list[torch.Tensor] = []
    for raw in _read_blocks(ckpt, fqn, budget, reporter):
        x = binnable(raw)
        pieces = _finite_part(x, acc)
        for good in pieces:
            _accumulate(good, acc, ranged=good is x and x.dtype.is_floating_point)
        kept = pieces if one_block else []
        del raw, x, pieces
    edges: list[float] = []
    counts: list[int] = []
    if bins > 0 and acc.finite > 0:
        lo, hi = hist_range(acc.lo, acc.hi)
        hist = torch.zeros(bins, dtype=torch.int64)
        again = () if one_block else _read_blocks(ckpt, fqn, budget, reporter)
        for pieces in itertools.chain([kept], (_finite_part(binnable(raw), _Totals()) for raw in again)):
            for good in pieces:
                add_counts(good, hist, lo, hi)
        edges = hist_edges(lo, hi, bins)
        counts = [int(c) for c in hist.tolist()]
    finite = acc.finite
    return TensorStats(
        fqn=fqn,
        dtype=dtype_name(entry.dtype) or "",
        count=acc.count,
        finite=finite,
        nan=acc.nan,
        posinf=acc.posinf,
        neginf=acc.neginf,
        zeros=acc.zeros,
        min=acc.lo if finite else math.nan,
        max=acc.hi if finite else math.nan,
        mean=acc.mean if finite else math.nan,
        std=math.sqrt(acc.m2 / finite) if finite else math.nan,
        hist_edges=edges,
        hist_counts=counts,
        note="complex values summarised by magnitude" if entry.dtype.is_complex else "",
    )
