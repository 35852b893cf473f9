"""How a distributed upload to S3 cuts the output into parts (:mod:`dcpstudio.core.ranks.parts`): S3's
rules (every part but an object's last at least 5 MiB, at most 10,000 parts) and the balance by bytes."""

from __future__ import annotations

import itertools

import pytest

from dcpstudio.core.ops.convert.layout import Layout
from dcpstudio.core.ranks.parts import MAX_PARTS, MIN_PART, plan_parts

GiB, MiB = 1 << 30, 1 << 20


def _layout(files: dict[str, int], value_files: tuple[str, ...] = ()) -> Layout:
    holes = [(name, 64, size - 128, 4) for name, size in files.items() if name not in value_files]
    return Layout(False, files, holes, [], crc=True)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_parts_follow_s3s_rules_and_balance_the_ranks(world: int) -> None:
    for files in (
        {"a": 64 * GiB},  # one large object
        {"model-1": 3 * GiB, "model-2": 3 * GiB + 12345, "model-3": 700 * MiB},  # shards of unequal size
        {f"__0_{k}.distcp": (k + 1) * 300 * MiB for k in range(12)},
        {"huge": 1000 * GiB},  # needs parts above 64 MiB to stay within 10,000
        {"small": 3 * MiB, "tiny": 1000},  # each one part, whatever its size
    ):
        layout = _layout({**files, ".metadata": 5000}, value_files=(".metadata",))
        parts = plan_parts(layout, world)
        assert {p.file for p in parts} == set(files)  # .metadata holds no tensor bytes: written whole
        for name, size in files.items():
            mine = [p for p in parts if p.file == name]
            assert [p.number for p in mine] == list(range(1, len(mine) + 1)) and len(mine) <= MAX_PARTS
            assert mine[0].start == 0 and mine[-1].end == size
            assert all(a.end == b.start for a, b in itertools.pairwise(mine))
            assert all(p.nbytes >= MIN_PART for p in mine[:-1]), name
        assert [p.rank for p in parts] == sorted(p.rank for p in parts)  # contiguous runs
        shares = [sum(p.nbytes for p in parts if p.rank == r) for r in range(world)]
        total = sum(files.values())
        if total >= 10 * GiB:
            assert all(abs(s - total / world) <= 0.1 * total / world for s in shares), (files, shares)
