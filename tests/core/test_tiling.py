"""The tiling check against a brute-force reference, and its cost on many chunks."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from dcpstudio.core.errors import CorruptCheckpointError, UnsupportedFormatError
from dcpstudio.core.formats.dcp.tiling import check_tiling

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _brute(shape: list[int], boxes: list[Box]) -> bool:
    """Every element of the tensor covered exactly once, by counting them."""
    seen: dict[tuple[int, ...], int] = {}
    for offsets, sizes in boxes:
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            return False
        for p in itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes, strict=True))):
            seen[p] = seen.get(p, 0) + 1
    return len(seen) == math.prod(shape) and all(v == 1 for v in seen.values())


def _guillotine(lo: list[int], hi: list[int], rng: random.Random, depth: int) -> list[Box]:
    k = rng.randrange(len(lo))
    if depth == 0 or rng.random() < 0.2 or hi[k] - lo[k] < 2:
        return [(tuple(lo), tuple(h - a for a, h in zip(lo, hi, strict=True)))]
    cut = rng.randrange(lo[k] + 1, hi[k])
    return _guillotine(lo, [*hi[:k], cut, *hi[k + 1 :]], rng, depth - 1) + _guillotine(
        [*lo[:k], cut, *lo[k + 1 :]], hi, rng, depth - 1
    )


def _grown(shape: list[int], rng: random.Random) -> list[Box]:
    """Boxes grown greedily from free cells: also tilings no sequence of straight cuts makes
    (pinwheels), which a slab-by-slab check would have to get right too."""
    free = set(itertools.product(*(range(d) for d in shape)))
    boxes = []
    for start in sorted(free):
        if start not in free:
            continue
        sizes = [1] * len(shape)
        for _ in range(4):
            k = rng.randrange(len(shape))
            grown = [*sizes[:k], sizes[k] + 1, *sizes[k + 1 :]]
            if start[k] + grown[k] <= shape[k] and all(
                p in free for p in itertools.product(*(range(o, o + s) for o, s in zip(start, grown, strict=True)))
            ):
                sizes = grown
        for p in itertools.product(*(range(o, o + s) for o, s in zip(start, sizes, strict=True))):
            free.discard(p)
        boxes.append((start, tuple(sizes)))
    return boxes


def _mutate(boxes: list[Box], rng: random.Random) -> list[Box]:
    out = list(boxes)
    k = rng.randrange(len(out))
    offsets, sizes = map(list, out[k])
    dim = rng.randrange(len(offsets))
    how = rng.randrange(5)
    if how == 0:
        offsets[dim] += rng.choice((-1, 1))  # moved: the same volume, an overlap and a gap
    elif how == 1:
        sizes[dim] += rng.choice((-1, 1))
    elif how == 2:
        out.append(out[k])
        return out
    elif how == 3:
        del out[k]
        return out
    else:
        sizes[dim] = 0  # an empty chunk somewhere, out of bounds or not
        offsets[dim] = rng.randrange(-1, 7)
    out[k] = (tuple(offsets), tuple(sizes))
    return out


def _accepts(shape: list[int], boxes: list[Box]) -> bool:
    try:
        check_tiling(tuple(shape), boxes, "t")
    except CorruptCheckpointError:
        return False
    return True


def test_matches_brute_force_on_random_tilings() -> None:
    rng = random.Random(24)
    valid = 0
    for case in range(3000):
        dims = rng.randint(1, 4)
        shape = [rng.randint(1, 5 if dims < 4 else 3) for _ in range(dims)]
        boxes = _grown(shape, rng) if case % 2 else _guillotine([0] * dims, shape, rng, 6)
        rng.shuffle(boxes)
        if rng.random() < 0.6:
            for _ in range(rng.randint(1, 2)):
                boxes = _mutate(boxes, rng) if boxes else boxes
        want = _brute(shape, boxes)
        valid += want
        assert _accepts(shape, boxes) == want, (shape, boxes)
    assert 1000 < valid < 2000  # both answers well represented


def test_same_volume_overlap_and_gap() -> None:
    # the volumes add up, but [0, 2) x [0, 2) holds one element twice and misses another
    boxes: list[Box] = [((0, 0), (1, 2)), ((1, 0), (1, 1)), ((0, 1), (1, 1))]
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        check_tiling((2, 2), boxes, "t")


def test_empty_shards_of_an_empty_tensor_tile_it() -> None:
    """A (0, 4) tensor sharded along dim 1 over 4 ranks: 4 empty regions (`--for-ranks 4 --layout shard1`)."""
    check_tiling((0, 4), [((0, c), (0, 1)) for c in range(4)], "t")
    with pytest.raises(CorruptCheckpointError, match="outside"):
        check_tiling((0, 4), [((0, 0), (0, 2)), ((0, 3), (0, 2))], "t")


def test_refuses_non_integers_and_huge_values() -> None:
    with pytest.raises(CorruptCheckpointError, match="not integers"):
        check_tiling((4,), [((0,), (2,)), ((2.0,), (2,))], "t")
    with pytest.raises(CorruptCheckpointError, match="not integers"):
        check_tiling((2,), [((0,), (True,)), ((1,), (1,))], "t")
    with pytest.raises(CorruptCheckpointError, match="outside"):
        check_tiling((4,), [((0,), (2,)), ((2**64,), (-(2**64) + 2,))], "t")
    with pytest.raises(CorruptCheckpointError, match="not a valid size"):
        check_tiling((2**63, 0), [((0, 0), (2**63, 0))], "t")


def test_irregular_splits_along_many_dimensions_are_refused_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    import dcpstudio.core.formats.dcp.tiling as tiling

    monkeypatch.setattr(tiling, "_CELLS", 64)
    boxes = _guillotine([0] * 4, [4] * 4, random.Random(1), 8)
    with pytest.raises(UnsupportedFormatError, match="too irregularly"):
        check_tiling((4, 4, 4, 4), boxes, "t")


def test_100k_chunks_sharing_their_rows_in_well_under_a_second() -> None:
    n = 100_000
    boxes: list[Box] = [((0, 3 * k), (8, 3)) for k in range(n)]
    random.Random(0).shuffle(boxes)
    start = time.perf_counter()
    check_tiling((8, 3 * n), boxes, "t")
    elapsed = time.perf_counter() - start
    boxes[5] = (boxes[5][0], (8, 4))
    boxes[6] = (boxes[6][0], (8, 2))
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        check_tiling((8, 3 * n), boxes, "t")
    assert elapsed < 10, elapsed


def test_a_grid_in_four_dimensions() -> None:
    cuts = [range(0, 12, 3), range(0, 10, 5), range(0, 8, 2), range(0, 6, 1)]
    boxes: list[Box] = [(p, (3, 5, 2, 1)) for p in itertools.product(*cuts)]
    check_tiling((12, 10, 8, 6), boxes, "t")
    boxes[0] = ((0, 0, 0, 0), (3, 5, 2, 2))
    boxes[-1] = (boxes[-1][0], (3, 5, 2, 0))  # the volumes still add up
    with pytest.raises(CorruptCheckpointError):
        check_tiling((12, 10, 8, 6), boxes, "t")
