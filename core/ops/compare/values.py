"""The numbers behind :mod:`.diff`: one block pair of a tensor compared, totals kept in a tally.

A block pair that is bitwise equal costs one word-wise ``torch.equal``; only pairs that differ are
widened to float64 (complex128) working copies -- of the block, never of the whole tensor. The
first mismatched element of a tensor is located once (a mask over the first differing block), so
reports can say where a difference starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...pickles.refs import is_tensor

if TYPE_CHECKING:
    import torch

_SPARSE = 8  # a block with at most 1 differing pair in this many is compared on those pairs alone

__all__ = ["Tally", "add_block", "first_mismatch", "objects_equal", "same_bytes", "sum_sq"]


@dataclass
class Tally:
    """A tensor pair's running totals; float64 sums over the finite pairs (when ``sums``)."""

    sums: bool = True  # norms kept (quick comparisons need none)
    count: int = 0
    mismatched: int = 0
    nonfinite: int = 0
    dmax: float = 0.0  # max |a - b| over the finite pairs
    max_rel: float = 0.0
    d2: float = 0.0  # sum |a - b|^2
    a2: float = 0.0  # sum |a|^2
    b2: float = 0.0
    ab: float = 0.0  # Re sum conj(a) b
    nonzero: bool = False  # a has a finite element other than 0
    first: tuple[int, ...] | None = None  # index of the first mismatched element
    partial: bool = False  # the comparison stopped at the first differing block

    def add_equal(self, a2: float) -> None:
        self.a2, self.b2, self.ab = self.a2 + a2, self.b2 + a2, self.ab + a2
        self.nonzero = self.nonzero or a2 > 0

    @property
    def max_abs(self) -> float:
        return math.inf if self.nonfinite else self.dmax

    def rel_l2(self) -> float:
        if self.dmax == 0:
            return 0.0
        return math.sqrt(self.d2) / math.sqrt(self.a2) if self.a2 else math.inf

    def cosine(self) -> float | None:
        if self.dmax == 0:
            return 1.0 if self.nonzero else None
        if self.a2 == 0 or self.b2 == 0:
            return None
        norms = math.sqrt(self.a2 * self.b2)
        if not 0 < norms < math.inf:  # the product under- or overflowed
            norms = math.sqrt(self.a2) * math.sqrt(self.b2)
        return max(-1.0, min(1.0, self.ab / norms))


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """C's ``memcmp`` (the GIL released while it runs), or None where it cannot be found."""
    try:
        libc = ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
        fn = libc.memcmp
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MEMCMP = _libc_memcmp()


_threads_lock = threading.Lock()
_single = 0  # comparisons running with torch held to one thread


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Hold torch's intra-op threads to one while blocks are compared. The work comes in cache-sized
    slices, each too small to gain from a thread team, while the reader threads need the cores:
    measured on 2 cores, a team whose second thread is descheduled makes every slice wait at its
    barrier -- a 256 MiB comparison took 2.7-5.2 s instead of 0.4 s when another process ran."""
    import torch

    global _single
    with _threads_lock:
        if _single == 0:
            one_torch_thread.saved = torch.get_num_threads()  # type: ignore[attr-defined]
            torch.set_num_threads(1)
        _single += 1
    try:
        yield
    finally:
        with _threads_lock:
            _single -= 1
            if _single == 0:
                torch.set_num_threads(one_torch_thread.saved)  # type: ignore[attr-defined]


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors of the same dtype hold the same bytes. Contiguous CPU tensors are compared
    with ``memcmp``: one thread, no OpenMP team whose spinning workers would slow the reader
    threads down (measured: 1 MiB block pairs took 4 ms each through ``torch.equal``)."""
    import torch

    nbytes = x.numel() * x.element_size()
    if nbytes != y.numel() * y.element_size():
        return False
    if nbytes == 0:
        return True
    if _MEMCMP is not None and x.device.type == y.device.type == "cpu" and x.is_contiguous() and y.is_contiguous():
        return _MEMCMP(x.data_ptr(), y.data_ptr(), nbytes) == 0
    xb, yb = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
    return torch.equal(xb, yb)


def _wide(x: torch.Tensor, complex_: bool) -> torch.Tensor:
    """A float64 (complex128) copy of ``x``: never the tensor read, which is then changed in place."""
    import torch

    return x.to(torch.complex128 if complex_ else torch.float64, copy=True)


def _dot(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x.vdot(y).real) if x.is_complex() else float(x.dot(y))


_SLICE = 1 << 16  # elements widened at a time: the float64 copies (512 KiB each) stay in cache
_scratch = threading.local()


def _sum_sq_wide(xd: torch.Tensor) -> float:
    s = _dot(xd, xd)
    if not math.isfinite(s):
        xd = xd[xd.isfinite()]
        s = _dot(xd, xd)
    return s


def sum_sq(x: torch.Tensor) -> float:
    """``sum |x|^2`` in float64 over the finite elements. Real values are widened a slice at a
    time into one reused buffer per thread, never as a float64 copy of the whole block."""
    import torch

    if x.is_complex() or x.numel() <= _SLICE:
        return _sum_sq_wide(_wide(x, x.is_complex()))
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = torch.empty(_SLICE, dtype=torch.float64)
    flat = x.reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), _SLICE):
        part = flat[start : start + _SLICE]
        wide = buf[: part.numel()]
        wide.copy_(part)
        total += _sum_sq_wide(wide)
    return total


def _add_values(
    t: Tally, xd: torch.Tensor, yd: torch.Tensor, rtol: float, atol: float, exact_bad: int | None, check: bool
) -> bool:
    """Add the pairs of wide ``xd``/``yd`` (assumed finite; both are overwritten) to ``t``. With
    ``check``, add nothing and return False when a difference is not finite (NaN or infinity)."""
    import torch

    if t.sums:
        a2, b2, ab = _dot(xd, xd), _dot(yd, yd), _dot(xd, yd)
    d = xd.sub_(yd).abs_() if not xd.is_complex() else xd.sub_(yd).abs()
    most = float(d.max()) if d.numel() else 0.0
    if check and not math.isfinite(most):
        return False
    if t.sums:
        t.a2, t.b2, t.ab, t.d2 = t.a2 + a2, t.b2 + b2, t.ab + ab, t.d2 + float(torch.dot(d, d))
        t.nonzero = t.nonzero or a2 > 0
    if exact_bad is not None:
        t.mismatched += exact_bad
    if most == 0:
        return True
    t.dmax = max(t.dmax, most)
    bb = yd.abs_() if not yd.is_complex() else yd.abs()
    if exact_bad is None and rtol == 0 and atol == 0:
        t.mismatched += int(torch.count_nonzero(d))
    elif exact_bad is None and most > atol:
        t.mismatched += int(torch.count_nonzero(d > bb.mul(rtol).add_(atol)))
    if float(bb.min()) == 0:
        zero = bb == 0
        if bool((d > atol).logical_and_(zero).any()):
            t.max_rel = math.inf
        bb.masked_fill_(zero, math.inf)  # those pairs are left out: d / inf = 0
    t.max_rel = max(t.max_rel, float(d.div_(bb).max()))
    return True


def _exact(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    """Integers (or bools) of one dtype at zero tolerance: compared as they are, never through float64
    (which rounds integers beyond 2**53)."""
    return x.dtype == y.dtype and not (x.is_floating_point() or x.is_complex()) and rtol == 0 and atol == 0


def _add_dense(t: Tally, x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> None:
    """Add a dense block pair. Real floats are widened a cache-sized slice at a time into two reused
    float64 buffers per thread (the same sums as widening the whole block, without allocating and
    faulting in two float64 copies of it per block)."""
    import torch

    real = (x.is_floating_point() and y.is_floating_point()) and not (x.is_complex() or y.is_complex())
    if not real or x.numel() <= _SLICE:
        _add_wide(t, x, y, rtol, atol)
        return
    buf = getattr(_scratch, "pair", None)
    if buf is None:
        buf = _scratch.pair = torch.empty(2, _SLICE, dtype=torch.float64)
    xf, yf = x.reshape(-1), y.reshape(-1)
    for start in range(0, xf.numel(), _SLICE):
        xs, ys = xf[start : start + _SLICE], yf[start : start + _SLICE]
        xd, yd = buf[0, : xs.numel()], buf[1, : xs.numel()]
        xd.copy_(xs)
        yd.copy_(ys)
        if not _add_values(t, xd, yd, rtol, atol, None, check=True):  # nothing added: a value not finite
            _add_wide(t, xs, ys, rtol, atol)


def _add_wide(t: Tally, x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> None:
    import torch

    exact_bad = None
    if _exact(x, y, rtol, atol):
        exact_bad = int(torch.count_nonzero(x != y))
    complex_ = x.is_complex() or y.is_complex()
    xd, yd = _wide(x, complex_), _wide(y, complex_)
    if _add_values(t, xd, yd, rtol, atol, exact_bad, check=True):
        return
    xd, yd = _wide(x, complex_), _wide(y, complex_)
    finite = torch.isfinite(xd).logical_and_(torch.isfinite(yd))
    xn, yn = xd[~finite], yd[~finite]
    bad = int(torch.count_nonzero(~((xn == yn) | (torch.isnan(xn) & torch.isnan(yn)))))
    if bad:
        t.mismatched += bad
        t.nonfinite += bad
    _add_values(t, xd[finite], yd[finite], rtol, atol, None, check=False)


def add_block(t: Tally, x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float, first: bool) -> int | None:
    """Add one block pair (flat, same length, not bitwise equal) to ``t``; with ``first``, return
    the flat index of its first pair outside the tolerance (None when all are inside).

    When few pairs differ (at most 1 in ``_SPARSE``, same dtype), only those are widened and
    compared; the equal pairs add their ``|a|^2`` to the norms (one float64 pass for ``||a||``,
    skipped when the tally keeps no sums)."""
    import torch

    if x.dtype == y.dtype:
        differ = x != y  # NaN pairs too: they are sorted out among the few
        if int(torch.count_nonzero(differ)) * _SPARSE <= x.numel():
            where = torch.nonzero(differ).reshape(-1)
            xs, ys = x[where], y[where]
            if t.sums:
                t.add_equal(max(0.0, sum_sq(x) - sum_sq(xs)))
            _add_dense(t, xs, ys, rtol, atol)
            j = first_mismatch(xs, ys, rtol, atol) if first else None
            return None if j is None else int(where[j])
    _add_dense(t, x, y, rtol, atol)
    return first_mismatch(x, y, rtol, atol) if first else None


def first_mismatch(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> int | None:
    """The flat index of the first pair of ``x``/``y`` (flat, same length) outside the tolerance,
    by the rule :func:`add_block` counts with: equal, both NaN, or ``|x - y| <= atol + rtol * |y|``."""
    import torch

    if _exact(x, y, rtol, atol):
        bad = x != y
    else:
        complex_ = x.is_complex() or y.is_complex()
        xd, yd = _wide(x, complex_), _wide(y, complex_)
        # equal, both NaN, or both finite and within the tolerance (|a - inf| <= inf is not close)
        bad = torch.isclose(xd, yd, rtol=rtol, atol=atol, equal_nan=True).logical_not_()
    if not bool(bad.any()):
        return None
    return int(torch.argmax(bad.view(torch.uint8)))


def unravel(flat: int, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[int, ...]:
    """The index in the whole tensor of element ``flat`` of the row-major box ``offsets``/``sizes``."""
    index = []
    for o, n in zip(reversed(offsets), reversed(sizes), strict=True):
        flat, i = divmod(flat, n)
        index.append(o + i)
    return tuple(reversed(index))


def objects_equal(x: Any, y: Any) -> bool:
    """Two values (tensors bit for bit, with dtype and shape; containers element by element; NaN
    equal to NaN) are the same value."""
    if is_tensor(x) or is_tensor(y):
        import torch

        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        )
    if isinstance(x, dict) and isinstance(y, dict):
        ys = {str(k): w for k, w in y.items()}
        return {str(k) for k in x} == set(ys) and all(objects_equal(v, ys[str(k)]) for k, v in x.items())
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(objects_equal(v, w) for v, w in zip(x, y, strict=True))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True  # the same value, stored twice (NaN != NaN)
    try:
        return bool(x == y)
    except Exception:
        return False
