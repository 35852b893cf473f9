"""Cutting a tensor into row-major boxes of bounded byte size, for streaming computations."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

__all__ = ["BLOCK_BUDGET", "blocks", "box_slices"]

BLOCK_BUDGET = 32 << 20
"""Bytes per block of a streamed computation: per-block costs vanish, a few blocks fit anywhere.
Blocks this large are unmapped when freed (glibc), so a long computation recycles its buffers
(:mod:`._buffers`) rather than faulting fresh pages in for every block."""


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
