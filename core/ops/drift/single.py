"""One block's sums in float32, for the tensors stored as float32, bfloat16 or float16 -- the
weights and moments of nearly every run -- at a fraction of the float64 path's cost.

The block is taken whole (bfloat16 and float16 converted to float32 once per block, float32 read
in place), with a handful of numpy calls per block, not per chunk: on a 2-core machine the Python
between calls, and the GIL it holds, cost as much as the arithmetic. Every dot product is reduced
per row of :data:`ROW` elements by BLAS's ``sdot`` (``np.vecdot``; below the 10,000 elements where
OpenBLAS starts threads, which spin on a shared machine's cores), the rows' results added in
float64: measured here ~1e-9 relative against exact sums of float32 weights, of Adam's second
moments and of bfloat16 values near 1 (whose few bits round with a bias; ``np.einsum``'s rows of
2 Ki gave 2e-6 there).

Per block: ‖W‖² directly, ΔW = W - W_prev into scratch, ‖ΔW‖² from it and max |ΔW| (with its
place: ``argmax`` and ``argmin`` of ΔW) -- never from the dot products: a step changes weights by
~1e-4 of their size, which would cancel -- and, row by row, ⟨W, W_prev⟩ = (‖W‖² + ‖W_prev‖² -
‖ΔW‖²) / 2 from sums already there, exact to the sums' rounding while ‖ΔW‖² is at most half of
‖W‖² + ‖W_prev‖² (cos ≳ 0.5), else that row in float64 (a float32 product of nearly orthogonal
vectors is mostly rounding); ⟨W, W_first⟩ directly in float32 for the rows whose |cos| is at least
0.5 (its rounding then ~1e-7 of it), the others in float64.
The largest change and its neighbours at two steps back are taken again in float64 at the element
found. A block holding a NaN or an Inf anywhere (a sum not finite: also a float32 overflow) is
left to :func:`~.metrics.accumulate` in float64, which counts and masks them: the rules see the same
sums either way (:func:`row_norms` gives the norms both paths use).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ...checkpoints.canonical import RawBuffers
from .metrics import StepSums, histogram, sample_range

__all__ = ["CHUNK", "FAST", "ROW", "Block", "accumulate32", "release_buffers", "row_norms"]

ROW = 1 << 10
CHUNK = 1 << 20  # elements per pass: few numpy calls a block (in 32 Ki, two threads ran no faster than one)
FAST = {"float32": "<f4", "bfloat16": "<u2", "float16": "<f2"}
"""Stored dtypes whose values are exactly float32 (bfloat16 as its bits)."""

_local = threading.local()
_F32 = RawBuffers(keep=8)  # converted blocks, recycled (fresh memory costs page faults)


def _rows32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise float32 dot products of two ``(rows, ROW)`` arrays, each row one BLAS ``sdot``."""
    vecdot = getattr(np, "vecdot", None)  # numpy >= 2.0
    if vecdot is not None:
        return vecdot(a, b)
    return np.matmul(a[:, None, :], b[:, :, None])[:, 0, 0]


def _scratch(n: int) -> np.ndarray:
    """This thread's float32 scratch of ``n`` elements (the largest block seen, kept)."""
    buf = getattr(_local, "d", None)
    if buf is None or len(buf) < n:
        buf = _local.d = np.empty(n, np.float32)
    return buf[:n]


class Block:
    """One step's block of a tensor: its stored elements (``raw``, numpy, in the stored dtype
    ``dtype``; bfloat16 as uint16) or, from torch's readers, its values already as float64.
    ``release`` gives the read buffer back."""

    __slots__ = ("_f32", "_f64", "dtype", "raw", "release")

    def __init__(self, raw: np.ndarray, dtype: str, release: Any = None) -> None:
        self.raw, self.dtype, self.release = raw, dtype, release
        self._f64: np.ndarray | None = raw if dtype == "f64" else None
        self._f32: np.ndarray | None = raw if dtype == "float32" else None

    def __len__(self) -> int:
        return len(self.raw)

    @property
    def fast(self) -> bool:
        return self.dtype in FAST

    def f64(self) -> np.ndarray:
        if self._f64 is None:
            self._f64 = (self.f32() if self.dtype == "bfloat16" else self.raw).astype(np.float64)
        return self._f64

    def f32(self) -> np.ndarray:
        """The block as float32: in place, or converted once (a bfloat16 block is compared at up
        to three steps: converting it once is the cheaper)."""
        if self._f32 is None:
            out = _F32.take(len(self.raw) * 4).view(np.float32)
            if self.dtype == "bfloat16":
                np.left_shift(self.raw, 16, out=out.view(np.uint32), dtype=np.uint32)
            else:
                out[...] = self.raw
            self._f32 = out
        return self._f32

    def value(self, k: int) -> float:
        if self.dtype == "bfloat16":
            return float(np.uint32(int(self.raw[k]) << 16).view(np.float32))
        return float(self.raw[k])

    def close(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None
        if self._f32 is not None and self.dtype != "float32":
            _F32.give(self._f32.view(np.uint8))
        self._f32 = self._f64 = None


def _rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row dot products (float64) of two flat float32 arrays: rows of :data:`ROW` elements, the
    last row the remainder."""
    n = len(a)
    k = n - n % ROW
    out = np.empty(k // ROW + (k < n), np.float64)
    if k:
        out[: k // ROW] = _rows32(a[:k].reshape(-1, ROW), b[:k].reshape(-1, ROW))
    if k < n:
        out[-1] = float(np.dot(a[k:], b[k:]))
    return out


def _rows64(a: np.ndarray, b: np.ndarray, which: np.ndarray) -> np.ndarray:
    """The dot products of rows ``which`` (a mask over :func:`_rows`' rows) in float64."""
    n = len(a)
    k = n - n % ROW
    full = which[: k // ROW]
    a2 = a[:k].reshape(-1, ROW)[full].astype(np.float64)
    b2 = b[:k].reshape(-1, ROW)[full].astype(np.float64)
    got = np.einsum("ij,ij->i", a2, b2)
    if k < n and which[-1]:
        got = np.append(got, float(np.dot(a[k:].astype(np.float64), b[k:].astype(np.float64))))
    return got


def row_norms(x: Block) -> np.ndarray:
    """‖x‖² of each row (an earlier step's, when the step itself was not computed: cached)."""
    xa = x.f32()
    return _rows(xa, xa)


def accumulate32(
    acc: StepSums,
    x: Block,
    start: int,
    numel: int,
    prev: tuple[Block, np.ndarray] | None,
    back2: Block | None,
    first: tuple[Block, np.ndarray] | None,
) -> np.ndarray | None:
    """Adds block ``x`` (elements ``start..`` of a tensor of ``numel``) to ``acc`` (fresh), comparing
    it with the previous step's and the first step's blocks (each with its rows' ‖·‖²) and the one
    before; returns its rows' ‖·‖², or None (``acc`` untouched) when a sum is not finite."""
    xa = x.f32()
    n = len(xa)
    fa = first[0].f32() if first is not None else None
    pa = prev[0].f32() if prev is not None else None
    nrows = -(-n // ROW)
    rx = np.empty(nrows, np.float64)
    rf = np.empty(nrows, np.float64) if fa is not None else None
    rd = np.empty(nrows, np.float64) if pa is not None else None
    best = -1.0
    best_at = 0
    d_buf = _scratch(min(n, CHUNK))
    for s in range(0, n, CHUNK):  # one pass for a block of up to CHUNK elements (the scratch stays bounded)
        e = min(n, s + CHUNK)
        r0, r1 = s // ROW, -(-e // ROW)
        xc = xa[s:e]
        rx[r0:r1] = _rows(xc, xc)
        if rf is not None and fa is not None:
            rf[r0:r1] = _rows(xc, fa[s:e])
        if rd is not None and pa is not None:
            d = d_buf[: e - s]
            np.subtract(xc, pa[s:e], out=d)
            rd[r0:r1] = _rows(d, d)
            hi_at, lo_at = int(d.argmax()), int(d.argmin())
            hi, lo = float(d[hi_at]), -float(d[lo_at])
            m, at = (hi, hi_at) if hi > lo or (hi == lo and hi_at < lo_at) else (lo, lo_at)
            if m > best:  # the first of the largest (a NaN never is: caught below)
                best, best_at = m, s + at
    xx = float(rx.sum())
    if not math.isfinite(xx):
        return None
    xf = dd = dp = 0.0
    if first is not None and fa is not None and rf is not None:
        small = rf * rf < 0.25 * rx * first[1]  # (a product not finite stays: caught below)
        if small.any():
            rf[small] = _rows64(xa, fa, small)
        xf = float(rf.sum())
    if prev is not None and pa is not None and rd is not None:
        dd = float(rd.sum())
        both = rx + prev[1]
        rp = (both - rd) / 2
        far = rd > 0.5 * both
        if far.any():
            rp[far] = _rows64(xa, pa, far)
        dp = float(rp.sum())
    if not math.isfinite(xf + dd + dp):
        return None
    acc.count = n
    acc.norm2 = xx
    if acc.hist is not None:
        acc.vmax = max(acc.vmax, float(xa.max()))
        histogram(acc, xa)
    if first is not None:
        acc.dot_first = xf
    if prev is not None:
        acc.dot_prev, acc.diff2_prev = dp, dd
        here = x.value(best_at)
        acc.max_prev, acc.max_prev_at = abs(here - prev[0].value(best_at)), start + best_at
        if back2 is not None:
            acc.back2_at_max = abs(here - back2.value(best_at))
    if numel == 1 and n == 1:
        acc.value = x.value(0)
    lo_s, hi_s, step = sample_range(start, n, numel)
    if lo_s < hi_s:
        acc.sample.extend(x.value(k) for k in range(lo_s - start, hi_s - start, step))
    return rx


def release_buffers() -> None:
    """Let the converted blocks' buffers go once a run is over (a worker's scratch goes with it)."""
    _F32.clear()
