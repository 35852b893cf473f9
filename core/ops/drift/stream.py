"""Reading a run once: tensor by tensor, block by block in row-major order, and for each block every
step in order -- so step k is compared with step k-1 while k is read, and each byte of each checkpoint
is read exactly once.

For one tensor, the blocks are cut by element count (:func:`~...io.blocks.blocks` at 8 bytes an
element), so the same block covers the same elements at every step whatever each step's dtype. Only
the blocks later steps still compare with are kept: the previous step's, the one before it (to tell a
transient fault from a lasting change) and the first step's -- about four blocks of
:data:`BLOCK_ELEMENTS` float64 values, whatever the run's size. The next block is read and converted
on a helper thread while this one is compared (the readers and numpy release the GIL).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ...checkpoints.base import Checkpoint
from ...checkpoints.model import Entry
from ...io.blocks import blocks, box_slices
from ...io.buffers import BufferPool
from ...progress import Reporter
from .metrics import StepSums, accumulate, as_float64, new_histogram, wants_histogram

__all__ = ["BLOCK_ELEMENTS", "Source", "stream_tensor"]

BLOCK_ELEMENTS = 1 << 20
"""Elements per block (8 MiB as float64): few enough that four kept blocks stay small, many enough
that per-block costs (a read call, a DCP chunk lookup) vanish."""


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


def stream_tensor(
    name: str,
    present: dict[int, Source],
    needed: set[int],
    reporter: Reporter,
    *,
    pool: ThreadPoolExecutor,
    block_elements: int = BLOCK_ELEMENTS,
) -> dict[int, StepSums]:
    """The sums of tensor ``name`` at each step of ``needed`` that holds it; ``present`` maps a step's
    index to where that step holds the tensor. Steps outside ``needed`` are read only as far as a
    needed step compares with them."""
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
        prev, back2, first = deps[i]
        acc = sums[i] = StepSums()
        acc.start(prev is not None, first is not None and first != i)
        acc.first = first if first != i else None
        if wants_histogram(name):
            acc.hist = new_histogram()
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i in read:
        by_shape.setdefault(present[i].shape, []).append(i)
    for shape, group in by_shape.items():
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        items = [(i, offsets, sizes) for offsets, sizes in blocks(shape, 8, block_elements * 8) for i in group]
        kept: dict[int, tuple[np.ndarray, bool]] = {}
        block_start = -1
        for (i, offsets, sizes), x in _prefetched(items, present, reporter, pool):
            flat = _flat_start(offsets, shape)
            if flat != block_start:
                kept.clear()  # a new block: earlier steps' blocks of the last one are done with
                block_start = flat
            per = len(x) // max(1, int(np.prod(sizes, dtype=np.int64)))  # values per element: 2 for complex
            start = flat * per
            if i in sums:
                prev, back2, first = deps[i]
                bad = accumulate(
                    sums[i],
                    x,
                    start,
                    numel * per,
                    kept.get(prev) if prev is not None else None,
                    kept.get(back2) if back2 is not None else None,
                    kept.get(first) if first is not None and first != i else None,
                )
            else:
                bad = not bool(np.isfinite(x).all())
            if last_use.get(i, -1) > i:
                kept[i] = (x, bad)
            for j in [j for j in kept if last_use.get(j, -1) <= i]:
                del kept[j]
            del x
    for acc in sums.values():
        acc.finish()
    return sums


def _flat_start(offsets: list[int], shape: tuple[int, ...]) -> int:
    flat = 0
    for o, n in zip(offsets, shape, strict=True):
        flat = flat * n + o
    return flat


def _read(source: Source, offsets: list[int], sizes: list[int], buffers: BufferPool) -> np.ndarray:
    with buffers.active():
        block = source.ckpt.read_tensor(source.fqn, box_slices(offsets, sizes))
    out = as_float64(block)
    buffers.give(block)
    return out


def _prefetched(
    items: list[tuple[int, list[int], list[int]]],
    present: dict[int, Source],
    reporter: Reporter,
    pool: ThreadPoolExecutor,
) -> Iterator[tuple[tuple[int, list[int], list[int]], np.ndarray]]:
    """Each item's block as float64, the next one read on ``pool`` while the caller works on this one."""
    buffers = BufferPool(keep=2)

    def submit(k: int) -> Future[np.ndarray]:
        i, offsets, sizes = items[k]
        return pool.submit(_read, present[i], offsets, sizes, buffers)

    ahead: Future[np.ndarray] | None = submit(0) if items else None
    try:
        for k, item in enumerate(items):
            assert ahead is not None
            x = ahead.result()
            ahead = submit(k + 1) if k + 1 < len(items) else None
            entry = present[item[0]].entry
            nbytes = int(np.prod(item[2], dtype=np.int64)) * (entry.dtype.itemsize if entry.dtype else 8)
            reporter.advance(nbytes, items=0, current=entry.fqn)
            yield item, x
    finally:
        if ahead is not None:
            ahead.cancel()
            _quietly(ahead)


def _quietly(future: Future[np.ndarray]) -> None:
    try:
        future.result()
    except BaseException:  # the caller is already unwinding with its own error
        return
