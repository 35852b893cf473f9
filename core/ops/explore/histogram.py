"""The one histogram binning: Details' statistics of a tensor and the value explorer's summary of a
slice call these, so the same values get the same bins and counts in both panes.

The range is the finite values' ``[lo, hi]`` (``[lo, lo + 1]`` when all are equal), split into
:data:`HIST_BINS` equal bins. Values are counted with ``histc`` in their own float type (integers
and half types in a wider one), which places each value by itself: how a tensor is cut into blocks
or strips never moves a value to another bin.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...pickles.tensor_io import numeric

if TYPE_CHECKING:
    import torch

__all__ = ["HIST_BINS", "add_counts", "binnable", "hist_edges", "hist_range"]

HIST_BINS = 40
"""Bins of every histogram the window draws."""
_SUB = 1 << 20  # elements counted at once: histc's float copy of a block stays small


def binnable(raw: torch.Tensor) -> torch.Tensor:
    """A flat view (or small copy) of ``raw`` in a dtype torch's reductions accept, values exact;
    complex values by magnitude, packed float4 by its values (:func:`~...pickles.tensor_io.numeric`)."""
    import torch

    x = numeric(raw).reshape(-1)
    if x.dtype.is_complex:
        return x.abs()
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    if x.dtype.is_floating_point:
        return x if x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else x.float()
    if x.dtype in (torch.uint16, torch.uint32):
        return x.to(torch.int64)
    if x.dtype == torch.uint64:
        return x.to(torch.float64)
    return x


def hist_range(lo: float, hi: float) -> tuple[float, float]:
    """The bins' span for finite values between ``lo`` and ``hi``."""
    return lo, hi if hi > lo else lo + 1


def hist_edges(lo: float, hi: float, bins: int = HIST_BINS) -> list[float]:
    """``bins + 1`` edges from ``lo`` to ``hi`` (no overflow where ``hi - lo`` would)."""
    return [lo * (1 - i / bins) + hi * (i / bins) for i in range(bins + 1)]


def add_counts(good: torch.Tensor, hist: torch.Tensor, lo: float, hi: float) -> None:
    """Adds the finite values ``good`` (flat, from :func:`binnable`) to ``hist`` (int64, one slot
    per bin) for bins spanning ``[lo, hi]``."""
    import torch

    for start in range(0, good.numel(), _SUB):
        part = good[start : start + _SUB]
        if not part.dtype.is_floating_point:
            part = part.to(torch.float64)
        elif part.element_size() < 4:  # bins placed in float32, not in the half type
            part = part.float()
        low, high = lo, hi
        if (high - low) * hist.numel() > torch.finfo(part.dtype).max:  # histc's arithmetic would overflow:
            scale = 2.0 ** -(math.ceil(math.log2(hist.numel())) + 2)  # bin scaled values (a power of two: exact)
            part, low, high = part * scale, low * scale, high * scale
        hist += torch.histc(part, bins=hist.numel(), min=low, max=high).to(torch.int64)
