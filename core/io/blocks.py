"""Cutting a tensor into row-major boxes of bounded byte size, for streaming computations."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

__all__ = ["BLOCK_BUDGET", "WINDOW_BUDGET", "blocks", "box_slices", "run_blocks", "strided_pieces"]

BLOCK_BUDGET = 32 << 20
"""Bytes per block of a streamed computation: per-block costs vanish, a few blocks fit anywhere.
Blocks this large are unmapped when freed (glibc), so a long computation recycles its buffers
(:mod:`.buffers`) rather than faulting fresh pages in for every block."""


WINDOW_BUDGET = 16 << 20
"""Bytes of a storage held at a time to read a strided view from (:func:`strided_pieces`): a storage
this small is read once for all the views of it that are read one after another."""


def box_slices(offsets: Sequence[int], sizes: Sequence[int]) -> list[slice]:
    """The box ``offsets + sizes`` as the region ``read_tensor`` takes: one slice per dimension."""
    return [slice(o, o + n) for o, n in zip(offsets, sizes, strict=True)]


def blocks(shape: Sequence[int], itemsize: int, budget: int) -> Iterator[tuple[list[int], list[int]]]:
    """Boxes ``(offsets, sizes)`` that tile ``shape`` in row-major order, each at most ``budget``
    bytes (or one element), each a contiguous run of the tensor's elements."""
    dims = len(shape)
    if dims == 0:
        yield [], []
        return
    if any(s == 0 for s in shape):
        return
    # the first dimension k whose trailing block fits: split dim k, iterate dims before it one by one
    inner = itemsize
    k = dims
    while k > 0 and inner * shape[k - 1] <= budget:
        k -= 1
        inner *= shape[k]
    if k == 0:
        yield [0] * dims, list(shape)
        return
    split = k - 1
    per = max(1, budget // inner)
    for outer in itertools.product(*(range(s) for s in shape[:split])):
        for start in range(0, shape[split], per):
            n = min(per, shape[split] - start)
            yield [*outer, start, *[0] * (dims - split - 1)], [*[1] * split, n, *shape[split + 1 :]]


def run_blocks(
    shape: Sequence[int], itemsize: int, start: int, stop: int, budget: int
) -> Iterator[tuple[list[int], list[int]]]:
    """Boxes ``(offsets, sizes)`` that tile the row-major elements ``[start, stop)`` of a tensor of
    ``shape`` in order, each a contiguous run of at most ``budget`` bytes (or one element): a
    16 MiB piece of a tensor's canonical bytes, which need not start or end on a row, read box by
    box from the chunks that hold it."""
    for offsets, sizes in _run_boxes(tuple(shape), start, stop):
        for o, s in blocks(sizes, itemsize, budget):  # runs of a run of the tensor: runs of it
            yield [a + b for a, b in zip(offsets, o, strict=True)], s


def _run_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[list[int], list[int]]]:
    """At most ``2 * len(shape) - 1`` boxes tiling the elements ``[start, stop)``, in order."""
    if start >= stop:
        return
    if not shape:
        yield [], []
        return
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    rest = shape[1:]
    if first == last:  # within one index of the first dimension
        for o, s in _run_boxes(rest, head, tail):
            yield [first, *o], [1, *s]
        return
    if head:
        for o, s in _run_boxes(rest, head, inner):
            yield [first, *o], [1, *s]
        first += 1
    if last > first:
        yield [first, *[0] * len(rest)], [last - first, *rest]
    if tail:
        for o, s in _run_boxes(rest, 0, tail):
            yield [last, *o], [1, *s]


def strided_pieces(sizes: Sequence[int], strides: Sequence[int], reach: int) -> Iterator[tuple[list[int], list[int]]]:
    """Boxes ``(offsets, sizes)`` that tile the box ``sizes`` of a view with element ``strides``,
    each reaching over at most ``reach`` consecutive storage elements (or being one element),
    largest stride outermost (so in ascending storage order where the dimensions nest, as views of
    a row-major storage do): a view with gaps (``t[::2]``) or in any order is read piece by piece
    through a window of ``reach`` elements, never through its whole storage.

    The dimensions with the smallest strides are kept whole while they fit, the next one is cut
    into runs that fit, and the rest are taken one index at a time, largest stride outermost."""
    dims = len(sizes)
    if any(n == 0 for n in sizes):
        return
    order = sorted(range(dims), key=lambda d: (-strides[d] if sizes[d] > 1 else 0, d))
    span = 1
    k = dims
    while k > 0 and span + (sizes[order[k - 1]] - 1) * strides[order[k - 1]] <= reach:
        k -= 1
        span += (sizes[order[k]] - 1) * strides[order[k]]
    if k == 0:
        yield [0] * dims, list(sizes)
        return
    split = order[k - 1]
    per = max(1, (reach - span) // strides[split] + 1)
    outer = order[: k - 1]
    for index in itertools.product(*(range(sizes[d]) for d in outer)):
        for start in range(0, sizes[split], per):
            offsets, part = [0] * dims, list(sizes)
            for d, i in zip(outer, index, strict=True):
                offsets[d], part[d] = i, 1
            offsets[split], part[split] = start, min(per, sizes[split] - start)
            yield offsets, part
