"""Streaming statistics of one tensor: bounded memory whatever the tensor's size.

The tensor is read block by block (row-major boxes of at most ``budget`` bytes); moments are
merged with Chan's parallel algorithm in float64, so the result matches a float64 computation over
the whole tensor. The histogram needs the range first, so it is a second pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._blocks import blocks
from .inspect import Checkpoint
from .model import dtype_name, refuse_expanded
from .progress import CancelToken, ProgressCallback, Reporter

if TYPE_CHECKING:
    import torch

__all__ = ["TensorStats", "tensor_stats"]


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


def _as_float64(block: torch.Tensor) -> torch.Tensor:
    import torch

    if block.dtype.is_complex:
        return block.abs().to(torch.float64)
    return block.to(torch.float64)


def _read_blocks(ckpt: Checkpoint, fqn: str, budget: int, reporter: Reporter) -> Iterator[torch.Tensor]:
    entry = ckpt.entry(fqn)
    assert entry.dtype is not None
    for offsets, sizes in blocks(entry.shape or (), entry.dtype.itemsize, budget):
        reporter.check()
        region = [slice(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
        block = ckpt.read_tensor(fqn, region)
        reporter.advance(block.numel() * block.element_size(), items=0, current=fqn)
        yield block.reshape(-1)


def tensor_stats(
    ckpt: Checkpoint,
    fqn: str,
    *,
    bins: int = 64,
    budget: int = 32 << 20,
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
    passes = 2 if bins > 0 else 1
    reporter = Reporter(progress, cancel, total_bytes=entry.nbytes * passes, total_items=1)
    n = finite = nan = posinf = neginf = zeros = 0
    mean = m2 = 0.0
    lo, hi = math.inf, -math.inf
    for raw in _read_blocks(ckpt, fqn, budget, reporter):
        x = _as_float64(raw)
        n += x.numel()
        isnan = torch.isnan(x)
        nan += int(isnan.sum())
        posinf += int(torch.isposinf(x).sum())
        neginf += int(torch.isneginf(x).sum())
        zeros += int((x == 0).sum())
        good = x[torch.isfinite(x)]
        k = good.numel()
        if k == 0:
            continue
        b_mean = float(good.mean())
        b_m2 = float(((good - b_mean) ** 2).sum())
        lo, hi = min(lo, float(good.min())), max(hi, float(good.max()))
        total = finite + k
        delta = b_mean - mean
        mean += delta * k / total
        m2 += b_m2 + delta * delta * finite * k / total
        finite = total
    edges: list[float] = []
    counts: list[int] = []
    if bins > 0 and finite > 0:
        hist = torch.zeros(bins, dtype=torch.float64)
        for raw in _read_blocks(ckpt, fqn, budget, reporter):
            x = _as_float64(raw)
            x = x[torch.isfinite(x)]
            if x.numel():
                hist += torch.histc(x, bins=bins, min=lo, max=hi if hi > lo else lo + 1)
        step = ((hi if hi > lo else lo + 1) - lo) / bins
        edges = [lo + i * step for i in range(bins + 1)]
        counts = [int(c) for c in hist.tolist()]
    return TensorStats(
        fqn=fqn,
        dtype=dtype_name(entry.dtype) or "",
        count=n,
        finite=finite,
        nan=nan,
        posinf=posinf,
        neginf=neginf,
        zeros=zeros,
        min=lo if finite else math.nan,
        max=hi if finite else math.nan,
        mean=mean if finite else math.nan,
        std=math.sqrt(m2 / finite) if finite else math.nan,
        hist_edges=edges,
        hist_counts=counts,
        note="complex values summarised by magnitude" if entry.dtype.is_complex else "",
    )
