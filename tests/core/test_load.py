"""Loading a torch.save file (or a DCP directory) into sharded state dicts on 1-4 gloo ranks."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dcpstudio.core.pickles.tree import iter_tensors
from dcpstudio.core.ranks.launch import LaunchError, launch
from dcpstudio.core.ranks.load import placements, run_load
from tests import _ranks


@pytest.fixture(scope="module")
def loadable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("load") / "model.pt"
    torch.save(_ranks.loadable_state_dict(), path)
    return path


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_loads_and_matches_the_source(loadable: Path, world: int) -> None:
    meshes = [(world,)] + ([(2, 2)] if world == 4 else [])
    results = launch(_ranks.load_all_layouts, (str(loadable), meshes), nprocs=world, timeout=240)
    assert len(results) == world
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == 4 * len(meshes)
        for layout, mesh, report in per_rank:
            assert report.rank == rank and report.ok, (layout, mesh, report.mismatches)
            assert report.checked == 11
    if world > 1:
        # shard0: the coordinator sends each rank its own rows only, never whole tensors
        shard0 = [
            r for layout, mesh, r in (x for per in results for x in per) if layout == "shard0" and mesh == (world,)
        ]
        total = sum(r.bytes_received for r in shard0)
        tensor_bytes = sum(t.numel() * t.element_size() for t in iter_tensors(_ranks.loadable_state_dict()))
        # each rank gets its own rows (and the 0-d tensors) plus the 4 small pickled values, never N x the tensors
        assert total < tensor_bytes + (world - 1) * 4 * 1500


def test_dcp_source_reshards_into_another_world_size(multirank_dcp: Path) -> None:
    reports = run_load(multirank_dcp, ranks=2, layout="shard1", timeout=240)
    assert [r.ok for r in reports] == [True, True]


def test_a_killed_rank_is_reported_and_nothing_is_left(loadable: Path) -> None:
    with pytest.raises(LaunchError, match=r"rank 1 was killed \(SIGKILL\)"):
        launch(_ranks.die_midway, (str(loadable),), nprocs=3, timeout=120)
    killed_at = float(Path(f"{loadable}.killed-at").read_text())
    assert time.time() - killed_at < 10  # reported (and the others stopped) within 10 s of the death
    assert multiprocessing.active_children() == []


def test_a_raising_rank_is_reported_with_its_rank(loadable: Path) -> None:
    with pytest.raises(LaunchError, match=r"rank 2: ValueError: bad shard on purpose"):
        launch(_ranks.raise_on_rank, (str(loadable),), nprocs=3, timeout=120)
    assert multiprocessing.active_children() == []


def test_a_hanging_rank_times_out(loadable: Path) -> None:
    """Whichever fires first -- the launcher's deadline, or gloo's own timeout on the rank left
    waiting (the process group's timeout is the launch timeout) -- every rank is stopped in time."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"did not finish|rank 0: .*Timed out"):
        launch(_ranks.hang_on_rank, (str(loadable),), nprocs=2, timeout=8)
    assert time.monotonic() - t0 < 20
    assert multiprocessing.active_children() == []


def test_hostile_source_fails_on_every_rank_without_hanging(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (exec, ("open('/tmp/SHOULD_NOT_EXIST_dcpstudio', 'w').close()",))

    torch.save({"w": torch.ones(4), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(LaunchError, match="refused to load"):
        run_load(tmp_path / "evil.pt", ranks=2, layout="shard0", timeout=120)
    assert not os.path.exists("/tmp/SHOULD_NOT_EXIST_dcpstudio")


def test_placements_per_layout() -> None:
    from torch.distributed.tensor import Replicate, Shard

    assert placements("shard0", 2, 1) == [Shard(0)]
    assert placements("shard1", 2, 1) == [Shard(1)] and placements("shard1", 1, 1) == [Shard(0)]
    assert placements("fsdp", 2, 2) == [Shard(0), Shard(1)] and placements("replicate", 3, 2) == [Replicate()] * 2
    assert placements("shard0", 0, 1) == [Replicate()]
    with pytest.raises(ValueError, match="unknown layout"):
        placements("zigzag", 2, 1)


def test_torchrun_entry_point(loadable: Path) -> None:
    port = _ranks.free_port()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "-m",
            "dcpstudio",
            "load",
            str(loadable),
            "--layout",
            "shard0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines[0].split()[:3] == ["rank", "load", "time"] and len(lines) == 3
    assert all("ok (11 entries)" in line for line in lines[1:])
