"""Whether chunk boxes tile a tensor exactly, in O(2^k · n log n) for n boxes split along k dimensions.

Comparing chunks pairwise is quadratic: 100,000 chunks sharing their rows took two hours. Here the
question is turned into one about a function instead: with ``F = Σ 1[box] - 1[tensor]`` (each
``1[...]`` the indicator of a box of the integer grid), the boxes tile the tensor exactly iff
``F ≡ 0``. A function of finite support vanishes iff its difference along dimension 0 does, and
that difference is, for each coordinate ``c`` where some box starts or ends, the signed sum of the
cross-sections of the boxes starting at ``c`` minus those ending there: the same question one
dimension lower, once per coordinate. Repeating it down to no dimensions leaves signed points,
whose weights must all cancel. Three things keep it small and exact:

- identical signed boxes in the same group are merged and dropped when their weights cancel (a
  grid's inner faces all do);
- the groups of one parent always sum to zero (each box adds its cross-section at its start and
  takes it away at its end), so the largest group of each parent follows from the others and is
  not expanded further;
- dimensions every box spans whole are dropped up front.

A layout that still grows past :data:`_CELLS` is refused (an irregular split along many
dimensions at once, never a grid): the check is exact or it says it cannot decide, never wrong.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from ...errors import CorruptCheckpointError, UnsupportedFormatError

__all__ = ["check_tiling"]

_CELLS = 1 << 25
"""int64 cells one level of the check may hold (256 MiB): 100,000 chunks split any way along six
dimensions, or a million along three, always fit."""

_INT64 = (1 << 63) - 1

Box = tuple[Sequence[int], Sequence[int]]


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], label: str) -> None:
    """The chunk boxes ``(offsets, sizes)`` cover the tensor exactly: each inside the shape, no two
    overlapping, and their volumes adding up to its element count (so no gaps either)."""
    dims = len(shape)
    offsets, sizes = [o for o, _ in boxes], [s for _, s in boxes]
    if not set(map(len, offsets)) | set(map(len, sizes)) <= {dims}:
        odd = next(len(o) for o, s in boxes if len(o) != dims or len(s) != dims)
        raise CorruptCheckpointError(f"{label}: a chunk has {odd} dimensions, the tensor {dims}")
    flat = list(itertools.chain(shape, itertools.chain.from_iterable(offsets), itertools.chain.from_iterable(sizes)))
    if not set(map(type, flat)) <= {int}:
        raise CorruptCheckpointError(f"{label}: a chunk's offsets or sizes are not integers")
    if any(not 0 <= d <= _INT64 for d in shape):
        raise CorruptCheckpointError(f"{label}: the tensor's shape {list(shape)} is not a valid size")
    arrays = _as_arrays(flat[dims:], len(boxes), dims)
    bad = _outside(shape, boxes, arrays)
    if bad is not None:
        raise CorruptCheckpointError(
            f"{label}: chunk at {list(boxes[bad][0])} of size {list(boxes[bad][1])} lies outside the tensor "
            f"{list(shape)}"
        )
    numel = math.prod(shape)
    total = _total(shape, sizes, arrays)
    if total != numel:
        how = "overlap" if total > numel else "leave gaps"
        raise CorruptCheckpointError(f"{label}: its chunks {how} (they hold {total} of {numel} elements)")
    if len(boxes) < 2 or not dims or not numel:  # empty boxes inside an empty tensor tile it
        return
    assert arrays is not None  # a value past int64 lies outside every shape that passed
    if not _vanishes(shape, *arrays, label):
        raise CorruptCheckpointError(
            f"{label}: its chunks overlap (their {len(boxes)} boxes hold {numel} elements but do not cover "
            f"the tensor {list(shape)})"
        )


def _as_arrays(flat: list[int], n: int, dims: int) -> tuple[Any, Any] | None:
    """Offsets and sizes (all offsets, then all sizes, in ``flat``) as ``n x dims`` int64 arrays,
    or None when a value does not fit one (then that box lies outside any shape that passed)."""
    if n < 2 or not dims:
        return None
    import numpy as np

    try:
        both = np.fromiter(flat, np.int64, count=2 * n * dims).reshape(2, n, dims)
    except OverflowError:
        return None
    return both[0], both[1]


def _outside(shape: Sequence[int], boxes: Sequence[Box], arrays: tuple[Any, Any] | None) -> int | None:
    """The index of the first box not inside the shape, if any."""
    if arrays is None:
        for k, (offsets, sizes) in enumerate(boxes):
            if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
                return k
        return None
    import numpy as np

    lo, size = arrays
    top = np.array(shape, dtype=np.int64)
    wrong = ((lo < 0) | (size < 0) | (lo > top - size)).any(axis=1)
    return int(np.argmax(wrong)) if wrong.any() else None


def _total(shape: Sequence[int], sizes: Sequence[Sequence[int]], arrays: tuple[Any, Any] | None) -> int:
    """The boxes' volumes summed, exactly: in int64 where no partial product can overflow (each
    box lies inside the shape), else with Python integers."""
    if arrays is None or len(sizes) * math.prod(d for d in shape if d) > _INT64:
        return sum(map(math.prod, sizes))
    return int(arrays[1].prod(axis=1).sum())


def _vanishes(shape: Sequence[int], lo: Any, size: Any, label: str) -> bool:
    """Whether ``Σ 1[box] - 1[tensor]`` is zero everywhere, for boxes known to lie inside."""
    import numpy as np

    n = len(lo)
    live = (size > 0).all(axis=1)
    top = np.array(shape, dtype=np.int64)
    hi = lo + size
    split = ~((lo[live] == 0) & (hi[live] == top)).all(axis=0)
    lo = np.concatenate([lo[live][:, split], np.zeros((1, int(split.sum())), np.int64)])
    hi = np.concatenate([hi[live][:, split], top[split][None, :]])
    weight = np.ones(len(lo), np.int64)
    weight[-1] = -1
    group = np.zeros(len(lo), np.int64)
    if not lo.shape[1]:
        return int(weight.sum()) == 0
    while lo.shape[1]:
        rest = lo.shape[1] - 1
        if 2 * len(lo) * (2 * rest + 3) > _CELLS:
            raise UnsupportedFormatError(
                f"{label}: its {n} chunks are split along {int(split.sum())} dimensions too irregularly to "
                "check that they tile the tensor"
            )
        group = np.concatenate([group, group])
        at = np.concatenate([lo[:, 0], hi[:, 0]])
        weight = np.concatenate([weight, -weight])
        lo = np.concatenate([lo[:, 1:], lo[:, 1:]])
        hi = np.concatenate([hi[:, 1:], hi[:, 1:]])
        group, at, lo, hi, weight = _merge(group, at, lo, hi, weight)
        group, lo, hi, weight = _regroup(group, at, lo, hi, weight)
        if not len(weight):
            return True
    return False


def _merge(group: Any, at: Any, lo: Any, hi: Any, weight: Any) -> tuple[Any, Any, Any, Any, Any]:
    """Rows sorted by (group, at, lo, hi), identical ones merged into one with their summed
    weight, and those whose weights cancel dropped."""
    import numpy as np

    keys = [*hi.T[::-1], *lo.T[::-1], at, group]  # lexsort: the last key is the primary one
    order = np.lexsort(keys)
    group, at, lo, hi, weight = group[order], at[order], lo[order], hi[order], weight[order]
    new = np.empty(len(group), bool)
    new[:1] = True
    new[1:] = (group[1:] != group[:-1]) | (at[1:] != at[:-1])
    if lo.shape[1]:
        new[1:] |= (lo[1:] != lo[:-1]).any(axis=1) | (hi[1:] != hi[:-1]).any(axis=1)
    starts = np.flatnonzero(new)
    summed = np.add.reduceat(weight, starts) if len(starts) else weight[:0]
    keep = starts[summed != 0]
    return group[keep], at[keep], lo[keep], hi[keep], summed[summed != 0]


def _regroup(group: Any, at: Any, lo: Any, hi: Any, weight: Any) -> tuple[Any, Any, Any, Any]:
    """Rows sorted by (group, at) put in one new group per (group, at), dropping each old group's
    largest new group (it is minus the sum of its siblings, so it vanishes when they do)."""
    import numpy as np

    if not len(group):
        return group, lo, hi, weight
    new = np.empty(len(group), bool)
    new[0] = True
    new[1:] = (group[1:] != group[:-1]) | (at[1:] != at[:-1])
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(group)))
    parents = group[starts]
    by_size = np.lexsort((-sizes, parents))  # per parent, its largest child first
    first = np.empty(len(by_size), bool)
    first[0] = True
    first[1:] = parents[by_size][1:] != parents[by_size][:-1]
    dropped = np.zeros(len(starts), bool)
    dropped[by_size[first]] = True
    child = np.cumsum(new) - 1
    keep = ~dropped[child]
    return child[keep], lo[keep], hi[keep], weight[keep]
