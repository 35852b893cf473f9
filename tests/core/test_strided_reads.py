"""Strided torch.save views (transposed, permuted, with gaps) are read through a bounded window of
their storage (issue 24): exactly what ``torch.load(weights_only=True)`` gives, block by block, and
``verify`` of many such views of one storage stays within a fixed memory budget."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import open_checkpoint
from dcpstudio.core.io.blocks import strided_pieces

ROOT = Path(__file__).resolve().parents[2]


def test_strided_pieces_tile_the_box_within_the_reach() -> None:
    rng = random.Random(7)
    for _ in range(300):
        dims = rng.randrange(0, 4)
        sizes = [rng.randrange(1, 6) for _ in range(dims)]
        strides = [rng.choice([0, 1, 2, 3, 7, 30, 100]) for _ in range(dims)]
        reach = rng.choice([1, 2, 5, 17, 64, 1000])
        seen: list[tuple[int, ...]] = []
        for offsets, part in strided_pieces(sizes, strides, reach):
            span = sum((n - 1) * s for n, s in zip(part, strides, strict=True)) + 1
            assert span <= reach or all(n == 1 for n in part), (sizes, strides, reach, part)
            seen.extend(itertools.product(*(range(o, o + n) for o, n in zip(offsets, part, strict=True))))
        assert sorted(seen) == sorted(itertools.product(*(range(n) for n in sizes)))


def _views(storage: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "t": storage.view(35, 33).t(),
        "step2": storage[::2],
        "perm": storage.view(5, 7, 33).permute(2, 0, 1),
        "cols": storage.view(35, 33)[:, ::3],
        "grid": storage.view(15, 77)[1::2, 3::4],
        "expanded": storage[:7].view(7, 1).expand(7, 9),
        "offset": storage[5:900:7],
        "row": storage.view(11, 105)[3],
    }


@pytest.mark.parametrize("window", [4, 60, 1 << 20])
def test_strided_views_and_their_regions_read_as_torch_loads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    monkeypatch.setattr("dcpstudio.core.checkpoints.torchsave.WINDOW_BUDGET", window)
    storage = torch.randn(3 * 5 * 7 * 11)
    state: dict[str, Any] = {**_views(storage), "half": torch.randn(40, 6).to(torch.bfloat16)[:, 1:5].t()}
    torch.save(state, tmp_path / "v.pt")
    want = torch.load(tmp_path / "v.pt", weights_only=True)
    rng = random.Random(window)
    with open_checkpoint(tmp_path / "v.pt") as ckpt:
        for name, value in want.items():
            got = ckpt.read_tensor(name)
            assert got.is_contiguous() and got.dtype == value.dtype and torch.equal(got, value), name
            for _ in range(6):
                region = []
                for n in value.shape:
                    start = rng.randrange(n)
                    region.append(slice(start, rng.randrange(start, n) + 1))
                assert torch.equal(ckpt.read_tensor(name, region), value[tuple(region)]), (name, region)


# VmHWM, not ru_maxrss: Linux carries the parent's high-water mark across fork + exec into the child's
# ru_maxrss (a pytest process at 1.5 GiB made this child "peak" at 1.5 GiB)
_CHILD = """
import json, sys
from pathlib import Path
from dcpstudio.core import diff, open_checkpoint
with open_checkpoint(sys.argv[1]) as a, open_checkpoint(sys.argv[2]) as b:
    r = diff(a, b)
values = {v.fqn: [v.mismatched, list(v.first_index or ())] for v in r.values}
hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
print(json.dumps({"rss": int(hwm.split()[1]) * 1024, "values": values, "compared": r.compared}))
"""


def test_verify_of_many_strided_views_of_one_storage_stays_in_a_memory_budget(tmp_path: Path) -> None:
    """96 strided views of one 16 MiB storage, and the same with one element changed: the code before
    read each view's whole storage per block, fragmenting the heap to over 600 MiB."""
    numel = 4 << 20
    kinds = [
        lambda s: s[::2],
        lambda s: s.view(1024, -1)[1::2, ::3],
        lambda s: s[1::5],
        lambda s: s.view(64, 64, -1)[:, ::2].permute(2, 0, 1),
    ]
    changed = 2 * 12345 + 1  # in the [1::5] views (an odd index: not in [::2])
    for side, bump in (("a", 0.0), ("b", 0.5)):
        storage = torch.arange(numel, dtype=torch.float32)
        storage[changed] += bump
        torch.save({f"layer.{i}.w": kinds[i % len(kinds)](storage) for i in range(96)}, tmp_path / f"{side}.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "a.pt"), str(tmp_path / "b.pt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    a, b = (torch.load(tmp_path / f"{side}.pt", weights_only=True) for side in "ab")
    want = {}
    for name in a:
        bad = (a[name] != b[name]).nonzero()
        if len(bad):
            want[name] = [len(bad), bad[0].tolist()]
    assert want and out["values"] == want
    assert out["compared"] == 96
    assert out["rss"] <= 560 << 20, f"peak RSS {out['rss'] >> 20} MiB"  # ~450 measured; torch alone: 220


def test_views_with_gaps_of_one_small_storage_read_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each side of a ``diff`` reads the 4 MiB storage of 64 views with gaps once (the code before
    read it whole for every block of every view: 64 times)."""
    import os

    from dcpstudio.core import diff

    storage = torch.arange(1 << 20, dtype=torch.float32)
    kinds = [storage[::2], storage.view(256, -1)[1::2, ::3], storage[1::5]]
    torch.save({f"w.{i}": kinds[i % len(kinds)] for i in range(64)}, tmp_path / "a.pt")
    read = [0]
    preadv = os.preadv

    def counting(fd: int, buffers: Any, offset: int) -> int:
        got = preadv(fd, buffers, offset)
        read[0] += got
        return got

    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "a.pt") as b:
        monkeypatch.setattr(os, "preadv", counting)
        assert diff(a, b).equal
    assert read[0] <= 2 * storage.nbytes + (1 << 20)
