"""The content digest and moments of a tensor's canonical bytes, the same whatever holds them.

A tensor's canonical bytes are its elements in row-major order, little-endian, contiguous -- what
``t.contiguous()`` holds on a little-endian machine, whatever the file kept. Its digest
(``sha256-tree:HEX``) is SHA-256 over a header ``tensor\\0DTYPE\\0SHAPE\\0`` followed by the SHA-256
of each 16 MiB piece of those bytes in order (the last piece shorter, none for an empty tensor):
pieces are hashed independently, so the two cores -- or the ranks of a distributed conversion --
hash one large tensor together, and the result does not depend on who hashed what. A file's
digest, by contrast, is the plain SHA-256 of its bytes (what ``sha256sum`` and the Hub print).

Moments (min, max, mean, std of the finite values; NaN and Inf counts) are reduced per piece on
64 Ki-element sub-blocks in cache -- float32 sums of values shifted by the piece's first finite
value, gathered in float64 across sub-blocks (relative error ~1e-7 against a float64 reference);
integers in float64 -- and pieces merged in order (Chan's formula), so they are deterministic too.
numpy only: no torch, no BLAS (its threads spin on both cores).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterable
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["ALGORITHM", "PIECE", "Moments", "TreeHasher", "canonical_header", "root_digest"]

ALGORITHM = "sha256-tree"
PIECE = 16 << 20  # a multiple of every element size


def canonical_header(dtype: str, shape: tuple[int, ...] | list[int]) -> bytes:
    return f"tensor\0{dtype}\0{','.join(map(str, shape))}\0".encode()


def root_digest(header: bytes, pieces: Iterable[bytes]) -> str:
    """The named digest of ``header`` and the SHA-256 digests of the pieces, in order."""
    h = hashlib.sha256(header)
    for p in pieces:
        h.update(p)
    return f"{ALGORITHM}:{h.hexdigest()}"


class TreeHasher:
    """The digest of bytes fed in order by :meth:`update`, in pieces of any size. With ``pool``,
    every piece is hashed there (hashlib releases the GIL): one found whole inside an update from the
    caller's buffer -- the futures :meth:`update` returns must finish before the caller reuses it --
    one split across updates gathered into a buffer of its own first."""

    def __init__(self, header: bytes, pool: Executor | None = None, total: int | None = None) -> None:
        self._header = header
        self._left = total  # bytes still to come, when known: a gathered piece is sized to it
        self._pool = pool
        self._parts: list[bytes | Future[bytes]] = []
        self._cur = hashlib.sha256()
        self._cur_n = 0
        self._acc: bytearray | None = None  # with a pool: the piece being gathered

    def update(self, data: bytes | bytearray | memoryview) -> list[Future[bytes]]:
        mv = memoryview(data).cast("B")
        submitted: list[Future[bytes]] = []
        i, n = 0, mv.nbytes
        if self._left is not None:
            self._left -= n
        while i < n:
            if self._pool is not None:
                if self._cur_n == 0 and n - i >= PIECE:  # a whole piece in place: hashed from the caller's buffer
                    submitted.append(self._submit(mv[i : i + PIECE]))
                    i += PIECE
                    continue
                if self._acc is None:  # a piece split across updates: gathered, then hashed
                    rest = PIECE if self._left is None else self._left + n - i
                    self._acc = bytearray(min(PIECE, rest))
                take = min(len(self._acc) - self._cur_n, n - i)
                self._acc[self._cur_n : self._cur_n + take] = mv[i : i + take]
                self._cur_n += take
                i += take
                if self._cur_n == len(self._acc):
                    self._submit(memoryview(self._acc))
                    self._acc, self._cur_n = None, 0
                continue
            take = min(PIECE - self._cur_n, n - i)
            self._cur.update(mv[i : i + take])
            self._cur_n += take
            i += take
            if self._cur_n == PIECE:
                self._parts.append(self._cur.digest())
                self._cur, self._cur_n = hashlib.sha256(), 0
        return submitted

    def _submit(self, data: memoryview) -> Future[bytes]:
        assert self._pool is not None
        fut = self._pool.submit(_sha256_digest, data)
        self._parts.append(fut)
        return fut

    def digest(self) -> str:
        """The named digest (waits for the pieces still being hashed)."""
        if self._left not in (None, 0):
            raise ValueError(f"{self._left} bytes fewer than announced were hashed")
        if self._cur_n and self._acc is not None:
            self._parts.append(_sha256_digest(memoryview(self._acc)[: self._cur_n]))
            self._acc, self._cur_n = None, 0
        elif self._cur_n:
            self._parts.append(self._cur.digest())
            self._cur, self._cur_n = hashlib.sha256(), 0
        return root_digest(self._header, (p if isinstance(p, bytes) else p.result() for p in self._parts))


def _sha256_digest(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


_SIMPLE = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "bool": "u1", "int8": "i1", "uint8": "u1",
           "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint16": "<u2", "uint32": "<u4",
           "uint64": "<u8"}  # fmt: skip
_ITEMSIZE = {"bfloat16": 2, **{k: int(v[-1]) for k, v in _SIMPLE.items()}}
_SUB = 1 << 16  # elements per sub-block: 256 KiB of float32, in cache
_local = threading.local()


def _scratch(kind: str) -> Any:
    """This thread's sub-block buffers, reused (fresh memory costs page faults)."""
    import numpy as np

    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {
            "f4": np.empty(_SUB, np.float32),
            "f8": np.empty(_SUB, np.float64),
            "u4": np.empty(_SUB, np.uint32),
        }
    return bufs[kind]


def _elements(dtype: str, data: memoryview) -> Any:
    """``data`` as a numpy array of its stored kind (bfloat16 as uint16), or None (float8, complex…)."""
    import numpy as np

    if dtype == "bfloat16":
        return np.frombuffer(data, dtype="<u2")
    if dtype in _SIMPLE:
        return np.frombuffer(data, dtype=_SIMPLE[dtype])
    return None


class Moments:
    """Moments of a run of elements fed in order by :meth:`add` (then :meth:`finish`), or of
    several runs merged. Each 64 Ki-element sub-block of the tensor's grid is reduced on its own
    (count, mean, sum of squared deviations) and the record combines them with exactly rounded
    sums, so the result does not depend on how the bytes were split or in which order runs are
    merged -- a manifest read back piece by piece on two threads records what ``hash`` computes."""

    def __init__(self) -> None:
        self.numeric = True
        self.lo: float | int | None = None
        self.hi: float | int | None = None
        self.nan = self.inf = 0
        self._blocks: list[tuple[int, float, float]] = []  # (n, mean, m2) per sub-block
        self._carry = bytearray()  # a sub-block split across updates

    @classmethod
    def of(cls, dtype: str, data: bytes | bytearray | memoryview) -> Moments:
        """The moments of one run of canonical bytes starting on the sub-block grid."""
        out = cls()
        out.add(dtype, data)
        out.finish(dtype)
        return out

    def add(self, dtype: str, data: bytes | bytearray | memoryview) -> None:
        """The next canonical bytes (a multiple of the element size)."""
        if not self.numeric:
            return
        if dtype not in _ITEMSIZE:
            self.numeric = False
            return
        mv = memoryview(data).cast("B")
        step = _SUB * _ITEMSIZE[dtype]
        at = 0
        if self._carry:
            at = min(step - len(self._carry), mv.nbytes)
            self._carry += mv[:at]
            if len(self._carry) < step:
                return
            self._reduce(dtype, memoryview(self._carry))
            self._carry = bytearray()
        whole = at + (mv.nbytes - at) // step * step
        if whole > at:
            self._reduce(dtype, mv[at:whole])
        if whole < mv.nbytes:
            self._carry += mv[whole:]

    def finish(self, dtype: str) -> None:
        """The last, partial sub-block (at the tensor's end) reduced."""
        if self._carry and self.numeric:
            self._reduce(dtype, memoryview(self._carry))
        self._carry = bytearray()

    def _reduce(self, dtype: str, data: memoryview) -> None:
        x = _elements(dtype, data)
        integral = dtype not in ("float32", "float64", "float16", "bfloat16")
        for start in range(0, x.size, _SUB):
            _sub_block(self, dtype, x[start : start + _SUB], integral)

    def merge(self, other: Moments) -> None:
        """Fold ``other`` (finished) in."""
        if not other.numeric or not self.numeric:
            self.numeric = False
            return
        self.nan += other.nan
        self.inf += other.inf
        self._blocks += other._blocks
        for v in (other.lo, other.hi):
            if v is not None:
                self._bound(v)

    def _bound(self, v: float | int) -> None:
        self.lo = v if self.lo is None else min(self.lo, v)
        self.hi = v if self.hi is None else max(self.hi, v)

    def record(self) -> dict[str, Any]:
        if not self.numeric:
            return {}
        n = sum(b[0] for b in self._blocks)
        if not n:
            return {"min": None, "max": None, "mean": None, "std": None, "nan": self.nan, "inf": self.inf}
        mean = math.fsum(k * m for k, m, _ in self._blocks) / n
        m2 = math.fsum(q for _, _, q in self._blocks) + math.fsum(k * (m - mean) ** 2 for k, m, _ in self._blocks)
        return {"min": self.lo, "max": self.hi, "mean": mean, "std": math.sqrt(max(m2, 0.0) / n), "nan": self.nan,
                "inf": self.inf}  # fmt: skip


def _sub_block(out: Moments, dtype: str, part: Any, integral: bool) -> None:
    import numpy as np

    n = part.size
    if dtype == "bfloat16":
        u = _scratch("u4")[:n]
        np.left_shift(part, 16, out=u, dtype=np.uint32)
        x = u.view(np.float32)
    elif dtype == "float16":
        x = _scratch("f4")[:n]
        x[...] = part
    else:
        x = part
    lo: float | int
    hi: float | int
    if integral:
        lo, hi = int(x.min()), int(x.max())
        shift = float(lo)
        b = _scratch("f8")[:n]
        np.subtract(x, lo, out=b, casting="unsafe")
    else:
        lo, hi = x.min(), x.max()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            out.nan += int(np.isnan(x).sum())
            out.inf += int(np.isinf(x).sum())
            x = x[np.isfinite(x)]
            n = x.size
            if not n:
                return
            lo, hi = x.min(), x.max()
        lo, hi = float(lo), float(hi)
        shift = float(x[0])  # before b is written: it may be x's own buffer (float16)
        b = (_scratch("f8") if x.dtype == np.float64 else _scratch("f4"))[:n]
        np.subtract(x, x.dtype.type(shift), out=b)  # shifted: no cancellation when |mean| >> std
    s1 = float(np.add.reduce(b))
    s2 = float(np.einsum("i,i->", b, b))  # not BLAS: its threads spin, burning both cores
    out._bound(lo)
    out._bound(hi)
    out._blocks.append((n, shift + s1 / n, max(s2 - s1 * s1 / n, 0.0)))
