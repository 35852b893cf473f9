"""2-D slices of N-D tensors: which part of a tensor a table shows, reading windows of it, the
values every pane shows for a window (:func:`display_cells`), and a bounded-memory summary of a
whole slice (a heatmap of bin means, a histogram, min and max).

A :class:`SliceSpec` picks one dimension to run down the rows, optionally one to run across the
columns, and a fixed index for every other dimension: ``[:, 3, :]`` of a ``[64, 8, 128]`` tensor
is ``SliceSpec(shape, rows=0, cols=2, index=(0, 3, 0))``. A window of it is read with
:meth:`Checkpoint.read_tensor` on a box, so only (about) the window's bytes are read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...checkpoints.opening import Checkpoint
from ...dtypes import DType
from ...io.blocks import BLOCK_BUDGET
from ...pickles.tensor_io import numeric
from ...progress import CancelToken, ProgressCallback, Reporter
from .histogram import HIST_BINS, add_counts, binnable, hist_edges, hist_range

if TYPE_CHECKING:
    import torch

__all__ = ["SliceSpec", "SliceSummary", "cell_note", "display_cells", "read_window", "summarise_slice"]


@dataclass(frozen=True)
class SliceSpec:
    shape: tuple[int, ...]
    rows: int | None = 0  # the dimension down the rows (None for a scalar)
    cols: int | None = 1  # the dimension across the columns (None: one column)
    index: tuple[int, ...] = ()  # an index for every dimension; those of rows and cols are ignored

    @classmethod
    def default(cls, shape: tuple[int, ...]) -> SliceSpec:
        """The first two dimensions, index 0 in the others."""
        shape = tuple(shape)
        return cls(shape, 0 if shape else None, 1 if len(shape) > 1 else None, (0,) * len(shape))

    def __post_init__(self) -> None:
        dims = len(self.shape)
        if len(self.index) != dims:
            raise ValueError(f"a slice of a {dims}-D tensor needs {dims} indices, got {len(self.index)}")
        for d in (self.rows, self.cols):
            if d is not None and not 0 <= d < dims:
                raise ValueError(f"dimension {d} is out of range for shape {list(self.shape)}")
        if self.rows is not None and self.rows == self.cols:
            raise ValueError("rows and columns must be different dimensions")
        if self.rows is None and self.cols is not None:
            raise ValueError("a slice with columns needs a rows dimension")
        if dims and self.rows is None:
            raise ValueError("a tensor with dimensions needs a rows dimension")
        for d, (i, n) in enumerate(zip(self.index, self.shape, strict=True)):
            if d not in (self.rows, self.cols) and not 0 <= i < n:
                raise ValueError(f"index {i} is out of range for dimension {d} of size {n}")

    @property
    def n_rows(self) -> int:
        return self.shape[self.rows] if self.rows is not None else 1

    @property
    def n_cols(self) -> int:
        return self.shape[self.cols] if self.cols is not None else 1

    @property
    def free(self) -> list[int]:
        """The dimensions held at a fixed index."""
        return [d for d in range(len(self.shape)) if d not in (self.rows, self.cols)]

    def region(self, r0: int, r1: int, c0: int, c1: int) -> list[slice]:
        out = []
        for d, i in enumerate(self.index):
            if d == self.rows:
                out.append(slice(r0, r1))
            elif d == self.cols:
                out.append(slice(c0, c1))
            else:
                out.append(slice(i, i + 1))
        return out

    def label(self) -> str:
        """``[:, 3, :]`` -- the slice in Python's indexing notation."""
        if not self.shape:
            return "[]"
        return "[" + ", ".join(":" if d in (self.rows, self.cols) else str(i) for d, i in enumerate(self.index)) + "]"


def read_window(ckpt: Checkpoint, fqn: str, spec: SliceSpec, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Rows ``r0:r1`` and columns ``c0:c1`` of the slice, as a 2-D tensor (reads only that box)."""
    r1, c1 = min(r1, spec.n_rows), min(c1, spec.n_cols)
    t = ckpt.read_tensor(fqn, spec.region(r0, r1, c0, c1))
    rows, cols = max(0, r1 - r0), max(0, c1 - c0)
    if spec.rows is not None and spec.cols is not None and spec.rows > spec.cols:
        return t.reshape(cols, rows).t()  # the box comes in the tensor's order: columns first
    return t.reshape(rows, cols)


def display_cells(t: torch.Tensor) -> Any:
    """``t``'s values as nested Python lists, one cell per torch element (``t.tolist()``'s shape),
    exact: half and 8-bit floats as float32, ``complex32`` as ``complex64``, and each element of a
    packed dtype (``float4_e2m1fn_x2``: a byte of two 4-bit floats, on which torch has no cast) as
    the tuple of its values, low nibble first (:func:`~...pickles.tensor_io.numeric`). Every pane that shows
    values calls this, so a cell means the same element everywhere."""
    import torch

    if str(t.dtype) == "torch.float4_e2m1fn_x2":
        values = numeric(t).reshape(*t.shape, 2).tolist()
        return _pairs(values, t.dim())
    if t.dtype.is_floating_point and t.dtype.itemsize < 4:
        t = t.float()
    elif t.dtype == torch.complex32:
        t = t.to(torch.complex64)
    return t.tolist()


def _pairs(values: Any, depth: int) -> Any:
    if depth == 0:
        return tuple(values)
    return [_pairs(v, depth - 1) for v in values]


def cell_note(dtype: DType | None) -> str:
    """What one cell of a packed dtype shows (for a caption or tooltip); empty for the others."""
    if dtype is None or dtype.pack == 1:
        return ""
    return f"each {dtype.name} element is a byte of {dtype.pack} 4-bit floats, shown low nibble | high nibble"


@dataclass
class SliceSummary:
    """A whole slice, summarised: ``heat[i][j]`` is the mean of the finite values in row bin ``i``
    and column bin ``j`` (NaN when it has none); bins split rows at ``row_edges`` and columns at
    ``col_edges``. The histogram counts finite values between ``hist_edges``. Values are those
    :func:`~.histogram.binnable` gives: both values of a packed element (``float4_e2m1fn_x2``)
    count, in the cell's heat bin and in ``count``, as Details' statistics count them."""

    spec: SliceSpec
    heat: list[list[float]]
    row_edges: list[int]
    col_edges: list[int]
    count: int = 0
    finite: int = 0
    min: float = math.nan
    max: float = math.nan
    hist_edges: list[float] = field(default_factory=list)
    hist_counts: list[int] = field(default_factory=list)


def _edges(n: int, bins: int) -> list[int]:
    bins = max(1, min(bins, n))
    return [n * k // bins for k in range(bins + 1)]


def summarise_slice(
    ckpt: Checkpoint,
    fqn: str,
    spec: SliceSpec,
    *,
    max_bins: tuple[int, int] = (256, 256),
    hist_bins: int = HIST_BINS,
    budget: int = BLOCK_BUDGET,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> SliceSummary:
    """Heatmap, range and histogram of a slice, reading it in strips of rows of at most ``budget``
    bytes (twice: the histogram needs the range). Complex values are summarised by magnitude. The
    histogram is binned as :func:`~.stats.tensor_stats` bins it (:mod:`.histogram`): a 2-D
    tensor's whole slice gets the bins and counts Details shows for the tensor."""
    import torch

    entry = ckpt.tensor_entry(fqn)
    assert entry.dtype is not None
    n_rows, n_cols = spec.n_rows, spec.n_cols
    row_edges, col_edges = _edges(n_rows, max_bins[0]), _edges(n_cols, max_bins[1])
    out = SliceSummary(spec, [], row_edges, col_edges)
    if n_rows == 0 or n_cols == 0:
        return out
    row_bin = torch.bucketize(torch.arange(n_rows), torch.tensor(row_edges[1:]), right=True)
    col_bin = torch.bucketize(torch.arange(n_cols), torch.tensor(col_edges[1:]), right=True)
    sums = torch.zeros(len(row_edges) - 1, len(col_edges) - 1, dtype=torch.float64)
    counts = torch.zeros_like(sums)
    strip = max(1, budget // max(1, n_cols * entry.dtype.itemsize))
    reporter = Reporter(progress, cancel, total_bytes=2 * n_rows * n_cols * entry.dtype.itemsize, total_items=1)
    lo, hi = math.inf, -math.inf

    def strips() -> Iterator[tuple[int, torch.Tensor]]:
        """Each strip's values as :func:`binnable` gives them (in the tensor's own float type),
        shaped ``[rows, cols, values per element]``: 1, or 2 for a packed float4 element."""
        for r0 in range(0, n_rows, strip):
            reporter.check()
            r1 = min(n_rows, r0 + strip)
            x = read_window(ckpt, fqn, spec, r0, r1, 0, n_cols)
            reporter.advance(x.numel() * x.element_size(), items=0, current=fqn)
            yield r0, binnable(x).reshape(*x.shape, -1)

    for r0, raw in strips():
        x = raw.to(torch.float64)
        finite = torch.isfinite(x)
        out.count += x.numel()
        out.finite += int(finite.sum())
        good = torch.where(finite, x, torch.zeros_like(x)).sum(-1)
        if bool(finite.any()):
            lo, hi = min(lo, float(x[finite].min())), max(hi, float(x[finite].max()))
        bins = row_bin[r0 : r0 + x.shape[0]]
        s = torch.zeros(x.shape[0], sums.shape[1], dtype=torch.float64).index_add_(1, col_bin, good)
        c = torch.zeros_like(s).index_add_(1, col_bin, finite.sum(-1).to(torch.float64))
        sums.index_add_(0, bins, s)
        counts.index_add_(0, bins, c)
    heat = torch.where(counts > 0, sums / counts.clamp_min(1), torch.full_like(sums, math.nan))
    out.heat = heat.tolist()
    if out.finite:
        out.min, out.max = lo, hi
        low, top = hist_range(lo, hi)
        hist = torch.zeros(hist_bins, dtype=torch.int64)
        for _, x in strips():
            x = x.reshape(-1)
            add_counts(x[torch.isfinite(x)] if x.dtype.is_floating_point else x, hist, low, top)
        out.hist_edges = hist_edges(low, top, hist_bins)
        out.hist_counts = [int(v) for v in hist.tolist()]
    return out
