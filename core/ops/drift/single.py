"""One block's sums in float32, for the tensors stored as float32, bfloat16 or float16 -- the
weights and moments of nearly every run -- at a fraction of the float64 path's cost.

The block is taken in chunks of :data:`CHUNK` elements, which stay in cache (float32 read in place,
bfloat16 and float16 converted once per block), and each dot product is reduced per row
of :data:`ROW` elements in float32 with ``np.einsum`` (not ``np.dot``: BLAS's threads spin on a shared
machine's cores), the rows' results added in float64: measured here ~1e-8 relative against exact
sums of float32 weights and of values near 1 (bfloat16 values, whose few bits round with a bias,
~2e-8; rows of 1 Ki elements gave 4e-7 there, of 64 Ki 1e-6).

Per chunk: ‖W‖² directly, ΔW = W - W_prev into scratch, ‖ΔW‖² and max |ΔW| from it (never from the
dot products: a step changes weights by ~1e-4 of their size, which would cancel), and
⟨W, W_prev⟩ = (‖W‖² + ‖W_prev‖² - ‖ΔW‖²) / 2 from sums already there -- exact to the sums' rounding
while ‖ΔW‖² is at most half of ‖W‖² + ‖W_prev‖² (cos ≳ 0.5), else in float64 (a float32 product
of nearly orthogonal vectors is mostly rounding); ⟨W, W_first⟩ directly in float32 when the chunk's
|cos| is at least 0.5 (its rounding then ~1e-7 of it), else in float64.
The largest change and its neighbours at two steps back are taken again in float64 at the element
found. A block holding a NaN or an Inf anywhere (a sum not finite: also a float32 overflow) is
left to :func:`~.metrics.accumulate` in float64, which counts and masks them: the rules see the same
sums either way.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ...checkpoints.canonical import RawBuffers
from .metrics import StepSums, histogram, sample_range

__all__ = ["CHUNK", "FAST", "ROW", "Block", "accumulate32", "chunk_norms", "release_buffers"]

CHUNK = 1 << 16
ROW = 1 << 7
FAST = {"float32": "<f4", "bfloat16": "<u2", "float16": "<f2"}
"""Stored dtypes whose values are exactly float32 (bfloat16 as its bits)."""

_local = threading.local()
_F32 = RawBuffers(keep=8)  # converted blocks, recycled (fresh memory costs page faults)


def _scratch(name: str) -> np.ndarray:
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {"d": np.empty(CHUNK, np.float32)}
    return bufs[name]


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
            if self.dtype == "bfloat16":
                self._f64 = (self.raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            else:
                self._f64 = self.raw.astype(np.float64)
        return self._f64

    def f32(self, lo: int, hi: int) -> np.ndarray:
        """Elements ``lo..hi`` as float32: in place, or from the whole block converted once (a
        bfloat16 block is compared at up to three steps: converting it once is the cheaper)."""
        if self._f32 is None:
            out = _F32.take(len(self.raw) * 4).view(np.float32)
            if self.dtype == "bfloat16":
                np.left_shift(self.raw, 16, out=out.view(np.uint32), dtype=np.uint32)
            else:
                out[...] = self.raw
            self._f32 = out
        return self._f32[lo:hi]

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


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    k = len(a) - len(a) % ROW
    s = 0.0
    if k:
        s = float(np.einsum("ij,ij->i", a[:k].reshape(-1, ROW), b[:k].reshape(-1, ROW)).sum(dtype=np.float64))
    if k < len(a):
        s += float(np.einsum("i,i->", a[k:], b[k:]))
    return s


def _inner(a: np.ndarray, b: np.ndarray, aa: float, bb: float, dd: float) -> float:
    """⟨a, b⟩ from ‖a‖², ‖b‖², ‖a - b‖² while that loses nothing (cos ≳ 0.5), else in float64:
    a float32 dot product of nearly orthogonal vectors keeps only its rounding (cos ~ 0.007 of an
    Adam moment to its first step came out 1e-6 off)."""
    if dd <= 0.5 * (aa + bb):
        return (aa + bb - dd) / 2
    return _dot64(a, b)


def _dot64(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = _scratch64("a")[: len(a)], _scratch64("b")[: len(b)]
    a64[...] = a
    b64[...] = b
    return float(np.einsum("i,i->", a64, b64))


def _scratch64(name: str) -> np.ndarray:
    bufs = getattr(_local, "bufs64", None)
    if bufs is None:
        bufs = _local.bufs64 = {k: np.empty(CHUNK, np.float64) for k in ("a", "b")}
    return bufs[name]


def chunk_norms(x: Block) -> list[float]:
    """‖x‖² of each chunk (an earlier step's, when the step itself was not computed: cached)."""
    return [_dot(c, c) for c in (x.f32(s, min(len(x), s + CHUNK)) for s in range(0, len(x), CHUNK))]


def accumulate32(
    acc: StepSums,
    x: Block,
    start: int,
    numel: int,
    prev: tuple[Block, list[float]] | None,
    back2: Block | None,
    first: tuple[Block, list[float]] | None,
) -> list[float] | None:
    """Adds block ``x`` (elements ``start..`` of a tensor of ``numel``) to ``acc`` (fresh), comparing
    it with the previous step's and the first step's blocks (each with its chunks' ‖·‖²) and the one before;
    returns its chunks' ‖·‖², or None (``acc`` untouched) when a sum is not finite."""
    n = len(x)
    norms: list[float] = []
    xx = xf = dd = dp = 0.0
    best: float | None = None
    best_at = 0
    hist = acc.hist
    vmax = acc.vmax
    d_buf = _scratch("d")
    for c, s in enumerate(range(0, n, CHUNK)):
        e = min(n, s + CHUNK)
        xc = x.f32(s, e)
        cx = _dot(xc, xc)
        if not math.isfinite(cx):  # before the histogram, which takes finite values
            break
        norms.append(cx)
        xx += cx
        d = d_buf[: e - s]
        if first is not None:
            fc = first[0].f32(s, e)
            cf = _dot(xc, fc)
            xf += cf if cf * cf >= 0.25 * cx * first[1][c] else _dot64(xc, fc)
        if prev is not None:
            pc = prev[0].f32(s, e)
            np.subtract(xc, pc, out=d)
            cd = _dot(d, d)
            dd += cd
            dp += _inner(xc, pc, cx, prev[1][c], cd)
            np.abs(d, out=d)
            m = float(d.max())
            if best is None or m > best:
                best, best_at = m, s + int(d.argmax())
        if hist is not None:
            vmax = max(vmax, float(xc.max()))
            histogram(acc, xc)
    if len(norms) * CHUNK < n or not math.isfinite(xx + xf + dd + dp):
        if hist is not None:
            hist[...] = 0
        return None
    acc.count = n
    acc.norm2 = xx
    acc.vmax = vmax
    if first is not None:
        acc.dot_first = xf
    if prev is not None and best is not None:
        acc.dot_prev, acc.diff2_prev = dp, dd
        here = x.value(best_at)
        acc.max_prev, acc.max_prev_at = abs(here - prev[0].value(best_at)), start + best_at
        if back2 is not None:
            acc.back2_at_max = abs(here - back2.value(best_at))
    if numel == 1 and n == 1:
        acc.value = x.value(0)
    lo, hi, step = sample_range(start, n, numel)
    if lo < hi:
        acc.sample.extend(x.value(k) for k in range(lo - start, hi - start, step))
    return norms


def release_buffers() -> None:
    """Let the converted blocks' buffers go once a run is over."""
    _F32.clear()
