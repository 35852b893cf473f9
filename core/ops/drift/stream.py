"""Reading a run once: tensor by tensor, block by block in row-major order, and for each block every
step in order -- so step k is compared with step k-1 while k is read, and each byte of each checkpoint
is read exactly once.

For one tensor, the blocks are cut by element count (:func:`~...io.blocks.blocks` at 8 bytes an
element), so the same block covers the same elements at every step whatever each step's dtype. One
*unit* of work is one block across the steps: only the blocks later steps still compare with are
kept -- the previous step's, the one before it (to tell a transient fault from a lasting change) and
the first step's. Units are independent: they run on a thread per core, up to :data:`THREADS` (the
readers and numpy release the GIL: one reads while another computes), a few ahead, and their sums
are merged in order (:func:`~.metrics.merge`), so the result does not depend on the threads.
Memory: about four blocks of :data:`BLOCK_ELEMENTS` elements per unit in flight.

A block whose bytes lie in place (:func:`~...checkpoints.canonical.canonical_source`) is read without
torch; float32, bfloat16 and float16 blocks are summed in float32 (:mod:`.single`), the rest -- and
any block holding a NaN or an Inf -- in float64 (:func:`~.metrics.accumulate`), blocks read through
torch's readers (compressed chunks, float8, complex, strided views) as float64 values.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...checkpoints.base import Checkpoint
from ...checkpoints.canonical import CanonicalSource, RawBuffers, canonical_source
from ...checkpoints.model import Entry, dtype_name
from ...io.blocks import blocks, box_slices
from ...io.buffers import BufferPool
from ...progress import Reporter
from .metrics import StepSums, accumulate, as_float64, merge, new_histogram, wants_histogram
from .single import FAST, Block, accumulate32, release_buffers, row_norms

__all__ = ["BLOCK_ELEMENTS", "THREADS", "Source", "stream_run"]

BLOCK_ELEMENTS = 1 << 20
"""Elements per block: few enough that the kept blocks stay small, many enough that per-block costs
(a read call, a DCP chunk lookup) vanish."""


def _cores() -> int:
    """The cores this process may run on (a container's or a job's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


THREADS = max(1, min(8, _cores()))
"""Blocks summed at once: a few numpy calls per block hold the GIL, so threads scale with the cores
(each holds about four blocks)."""

_PLAIN = {**FAST, "float64": "<f8", "bool": "u1", "int8": "i1", "uint8": "u1", "int16": "<i2", "int32": "<i4",
          "int64": "<i8", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8"}  # fmt: skip
"""Stored dtypes read without torch (bytes in place), as numpy kinds."""


@dataclass(frozen=True)
class Source:
    """Where one step holds one tensor."""

    ckpt: Checkpoint
    fqn: str
    entry: Entry

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape or ())


def _dependencies(i: int, present: dict[int, Source]) -> tuple[int | None, int | None, int | None]:
    """The steps step ``i`` compares with: the previous and the one before (when they hold the
    tensor in the same shape) and the first step that holds it in that shape."""
    shape = present[i].shape

    def same(j: int) -> int | None:
        return j if j in present and present[j].shape == shape else None

    first = next(j for j in sorted(present) if present[j].shape == shape)
    return same(i - 1), same(i - 2), first


@dataclass
class _Tensor:
    """One tensor's plan: which steps are computed, what each compares with, how each is read."""

    name: str
    present: dict[int, Source]
    deps: dict[int, tuple[int | None, int | None, int | None]]
    last_use: dict[int, int]
    sums: dict[int, StepSums]
    readers: dict[int, CanonicalSource | None] = field(default_factory=dict)
    units: list[tuple[tuple[int, ...], list[int], list[int], list[int]]] = field(default_factory=list)


def _plan(name: str, present: dict[int, Source], needed: set[int], block_elements: int) -> _Tensor:
    wanted = sorted(i for i in needed if i in present)
    deps = {i: _dependencies(i, present) for i in wanted}
    read = sorted({*wanted, *(j for d in deps.values() for j in d if j is not None)})
    last_use: dict[int, int] = {}
    for i in wanted:
        for j in deps[i]:
            if j is not None:
                last_use[j] = max(last_use.get(j, -1), i)
    sums: dict[int, StepSums] = {}
    for i in wanted:
        prev, _, first = deps[i]
        acc = sums[i] = StepSums()
        acc.start(prev is not None, first is not None and first != i)
        acc.first = first if first != i else None
        if wants_histogram(name):
            acc.hist = new_histogram()
    t = _Tensor(name, present, deps, last_use, sums)
    for i in read:
        t.readers[i] = _in_place(present[i])
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i in read:
        by_shape.setdefault(present[i].shape, []).append(i)
    for shape, group in by_shape.items():
        t.units += [(shape, offsets, sizes, group) for offsets, sizes in blocks(shape, 8, block_elements * 8)]
    return t


def _in_place(source: Source) -> CanonicalSource | None:
    dtype = dtype_name(source.entry.dtype) or ""
    if sys.byteorder != "little" or dtype not in _PLAIN:
        return None
    got = canonical_source(source.ckpt, source.fqn)
    return got if got is not None and got.boxed else None


def _flat_start(offsets: list[int], shape: tuple[int, ...]) -> int:
    flat = 0
    for o, n in zip(offsets, shape, strict=True):
        flat = flat * n + o
    return flat


_RAW = RawBuffers(keep=16)


def _read(t: _Tensor, i: int, offsets: list[int], sizes: list[int], buffers: BufferPool) -> Block:
    reader, source = t.readers[i], t.present[i]
    if reader is not None:
        dtype = dtype_name(source.entry.dtype) or ""
        buf = reader.read(offsets, sizes, _RAW)
        return Block(buf.view(_PLAIN[dtype]), dtype, lambda: _RAW.give(buf))
    with buffers.active():
        block = source.ckpt.read_tensor(source.fqn, box_slices(offsets, sizes))
    out = as_float64(block)
    buffers.give(block)
    return Block(out, "f64")


def _unit(
    t: _Tensor, shape: tuple[int, ...], offsets: list[int], sizes: list[int], group: list[int], buffers: BufferPool
) -> dict[int, StepSums]:
    """The sums of one block at each computed step of ``group`` (the steps holding the tensor in
    ``shape``), reading the block of every step of the group once."""
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    elements = int(np.prod(sizes, dtype=np.int64))
    flat = _flat_start(offsets, shape)
    kept: dict[int, Block] = {}
    norms: dict[int, np.ndarray] = {}
    parts: dict[int, StepSums] = {}
    try:
        for i in group:
            x = _read(t, i, offsets, sizes, buffers)
            try:
                if i in t.sums:
                    parts[i], got = _sums(t, i, x, kept, norms, flat, numel, elements)
                    if got is not None:
                        norms[i] = got
                if t.last_use.get(i, -1) > i:
                    kept[i] = x
                    x = None  # type: ignore[assignment]
            finally:
                if x is not None:
                    x.close()
            for j in [j for j in kept if t.last_use.get(j, -1) <= i]:
                kept.pop(j).close()
                norms.pop(j, None)
    finally:
        for b in kept.values():
            b.close()
    return parts


def _sums(
    t: _Tensor,
    i: int,
    x: Block,
    kept: dict[int, Block],
    norms: dict[int, np.ndarray],
    flat: int,
    numel: int,
    elements: int,
) -> tuple[StepSums, np.ndarray | None]:
    prev_i, back2_i, first_i = t.deps[i]
    prev = kept.get(prev_i) if prev_i is not None else None
    back2 = kept.get(back2_i) if back2_i is not None else None
    first = kept.get(first_i) if first_i is not None and first_i != i else None
    total = t.sums[i]
    part = StepSums()
    part.start(prev is not None, first is not None)
    if total.hist is not None:
        part.hist = new_histogram()
    if x.fast and all(b is None or b.fast for b in (prev, back2, first)):
        got = accumulate32(
            part, x, flat, numel, _with_norms(prev, prev_i, norms), back2, _with_norms(first, first_i, norms)
        )
        if got is not None:
            return part, got
    per = len(x) // max(1, elements)  # values per element: 2 for complex
    accumulate(
        part,
        x.f64(),
        flat * per,
        numel * per,
        (prev.f64(), True) if prev is not None else None,
        (back2.f64(), True) if back2 is not None else None,
        (first.f64(), True) if first is not None else None,
    )
    if x.fast and part.nan + part.inf == 0:  # a neighbour's NaN sent it here: ‖x‖² as the fast path sums it,
        got = row_norms(x)  # so equal blocks have equal norms whichever path (the reverted rule)
        if np.isfinite(got).all():
            part.norm2 = float(got.sum())
            return part, got
    return part, None


def _with_norms(b: Block | None, j: int | None, norms: dict[int, np.ndarray]) -> tuple[Block, np.ndarray] | None:
    if b is None or j is None:
        return None
    if j not in norms:
        norms[j] = row_norms(b)
    return b, norms[j]


def stream_run(
    names: list[str],
    presence: dict[str, dict[int, Source]],
    needed: set[int],
    reporter: Reporter,
    *,
    block_elements: int = BLOCK_ELEMENTS,
    threads: int | None = None,
) -> Iterator[tuple[str, dict[int, StepSums]]]:
    """Each tensor of ``names`` with its sums at each step of ``needed`` that holds it, in order;
    ``presence[name]`` maps a step's index to where that step holds the tensor. Steps outside
    ``needed`` are read only as far as a needed step compares with them."""
    threads = threads or THREADS
    buffers = BufferPool(keep=2 * threads)
    ahead = 2 * threads
    inflight: deque[tuple[_Tensor, int, Future[dict[int, StepSums]]]] = deque()

    def units() -> Iterator[tuple[_Tensor, int]]:
        for name in names:
            t = _plan(name, presence[name], needed, block_elements)
            for k in range(len(t.units)):
                yield t, k
            if not t.units:
                yield t, -1

    def run(t: _Tensor, k: int) -> dict[int, StepSums]:
        return _unit(t, *t.units[k], buffers) if k >= 0 else {}

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dcpstudio-drift") as pool:
        todo = units()
        try:
            for t, k in todo:
                inflight.append((t, k, pool.submit(run, t, k)))
                if len(inflight) < ahead:
                    continue
                yield from _drain(inflight, reporter, keep=ahead - 1)
            yield from _drain(inflight, reporter, keep=0)
        finally:
            for _, _, fut in inflight:
                fut.cancel()
            for _, _, fut in inflight:
                _quietly(fut)
            _RAW.clear()
            release_buffers()


def _drain(
    inflight: deque[tuple[_Tensor, int, Future[dict[int, StepSums]]]], reporter: Reporter, keep: int
) -> Iterator[tuple[str, dict[int, StepSums]]]:
    """Merges the oldest units' sums until ``keep`` are in flight; yields each tensor done."""
    while len(inflight) > keep:
        reporter.check()
        t, k, fut = inflight[0]
        parts = fut.result()
        inflight.popleft()
        if k >= 0:
            _, _, sizes, group = t.units[k]
            elements = int(np.prod(sizes, dtype=np.int64))
            for i in group:
                entry = t.present[i].entry
                reporter.advance(elements * (entry.dtype.itemsize if entry.dtype else 8), items=0, current=entry.fqn)
            for i, part in parts.items():
                merge(t.sums[i], part)
        if k < 0 or k == len(t.units) - 1:
            for acc in t.sums.values():
                acc.finish()
            yield t.name, t.sums


def _quietly(future: Future[Any]) -> None:
    try:
        future.result()
    except BaseException:  # the caller is already unwinding with its own error
        return
