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


def test_a_crc_probe_changes_every_byte_of_its_field_and_names_its_tensor() -> None:
    """The second layout's CRC per tensor has no zero byte (every byte of a field differs from the
    first layout's 0) and gives the tensor back; a field straddling two parts is filled in each."""
    from dcpstudio.core.ranks.parts import Part, _probe, _probed, patch

    for h in (0, 1, 254, 255, 256, 255**2 - 1, 255**3 + 7, 255**4 - 1):
        field = _probe(h).to_bytes(4, "little")
        assert 0 not in field and _probed(field) == h
    left, right = Part("f", 1, 0, 10, 0), Part("f", 2, 10, 20, 1)
    a, b = bytearray(10), bytearray(10)
    patch(left, a, [(8, 3)], {3: 0x44332211})
    patch(right, b, [(8, 3)], {3: 0x44332211})
    assert bytes(a[8:] + b[:2]) == bytes([0x11, 0x22, 0x33, 0x44]) and not any(a[:8]) and not any(b[2:])
