"""Our readers with torch's planners: the seed's documented pairing (``DynamicMetaLoadPlanner``,
whose metadata is each rank's own shards) as well as ``DefaultLoadPlanner`` and ours, on 2 and 4
gloo ranks, into FSDP2 parameters and DTensors -- uneven shards and an empty one included."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core.ranks.launch import launch


def source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "net1.weight": torch.randn(10, 6, generator=g),  # 10 rows on 4 ranks: 3, 3, 3, 1
        "net1.bias": torch.arange(10.0),
        "net2.weight": torch.randn(3, 10, generator=g),  # 3 rows on 4 ranks: one rank holds nothing
        "net2.bias": torch.randn(3, generator=g),
        "cols": torch.randn(5, 7, generator=g).bfloat16(),  # cut by columns, cast to float32 on load
    }


def _targets(world: int) -> tuple[dict[str, Any], Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential()
    model.add_module("net1", torch.nn.Linear(6, 10))
    model.add_module("net2", torch.nn.Linear(10, 3))
    fully_shard(model, mesh=mesh)
    sd: dict[str, Any] = dict(model.state_dict())
    for v in sd.values():
        v.to_local().fill_(-1.0)
    sd["cols"] = distribute_tensor(torch.full((5, 7), -1.0), mesh, [Shard(1)])
    return sd, mesh


def _wrong(sd: dict[str, Any]) -> list[str]:
    """The entries whose local shard differs from the same region of the source."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    wrong = []
    for fqn, want in source().items():
        got = sd[fqn]
        shape, offset = compute_local_shape_and_global_offset(got.shape, got.device_mesh, got.placements)
        region = want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        if not torch.equal(got.to_local(), region.to(got.dtype)):
            wrong.append(fqn)
    return wrong


def pairings_worker(rank: int, world: int, report: Any, folder: str) -> dict[str, list[str]]:
    """Every reader of ours with every planner; returns, per pairing, the entries loaded wrong."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.formats.dcp.storage import DCPReader, unwrap_error
    from dcpstudio.core.ranks.distributed import CheckpointReader

    root = Path(folder)
    by_cols = root / f"dcp-cols-{world}"  # chunks cut by columns: each row shard spans them all
    _, mesh = _targets(world)
    dcp.save({k: distribute_tensor(v, mesh, [Shard(v.dim() - 1)]) for k, v in source().items()}, checkpoint_id=by_cols)
    readers = {
        "torch.save": lambda: CheckpointReader(root / "model.pt"),
        "dcp-1-rank": lambda: DCPReader(root / "dcp-one"),
        "dcp-by-cols": lambda: DCPReader(by_cols),
    }
    planners = {"dynamic": DynamicMetaLoadPlanner, "default": DefaultLoadPlanner, "safe": SafeLoadPlanner}
    out = {}
    for rname, reader in readers.items():
        for pname, planner in planners.items():
            sd, _ = _targets(world)
            try:
                dcp.load(sd, storage_reader=reader(), planner=planner())
            except CheckpointException as e:
                error = unwrap_error(e)
                out[f"{rname}+{pname}"] = [f"{type(error).__name__}: {error}"]
                continue
            out[f"{rname}+{pname}"] = _wrong(sd)
    absent = {"absent": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])}  # every rank waits for it alone
    try:
        dcp.load(
            absent, storage_reader=CheckpointReader(root / "model.pt", local_reads=False), planner=planners["dynamic"]()
        )
    except CheckpointException as e:
        out["refused"] = [str(unwrap_error(e))]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("pairings")
    torch.save(source(), root / "model.pt")
    dcp.save(source(), checkpoint_id=root / "dcp-one", no_dist=True)
    return root


@pytest.mark.parametrize("world", [2, 4])
def test_every_reader_gives_each_rank_its_own_shard_with_every_planner(checkpoints: Path, world: int) -> None:
    results = launch(pairings_worker, (str(checkpoints),), nprocs=world, timeout=120)
    refusals = [per_pairing.pop("refused") for per_pairing in results]
    assert all("asks for 'absent' as a tensor; the checkpoint holds nothing there" in r[0] for r in refusals), refusals
    assert [len(per_pairing) for per_pairing in results] == [9] * world
    wrong = [f"rank {r} {k}: {v}" for r, per_pairing in enumerate(results) for k, v in per_pairing.items() if v]
    assert not wrong, "; ".join(wrong)


@pytest.mark.parametrize("reader", ["torch.save", "dcp"])
@pytest.mark.parametrize(
    ("target", "refusal"),
    [
        ({"net1.bias": torch.zeros(12)}, r"'net1.bias' \[12\] at \[0\]; the checkpoint stores a tensor of \[10\]"),
        ({"net1.bias": torch.zeros(10), "absent": torch.zeros(2)}, r"'absent'.*the checkpoint (holds|stores) no"),
    ],
)
def test_a_region_the_checkpoint_does_not_store_is_refused(
    checkpoints: Path, reader: str, target: dict[str, torch.Tensor], refusal: str
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner

    from dcpstudio.core.errors import DCPStudioError
    from dcpstudio.core.formats.dcp.storage import DCPReader, unwrap_error
    from dcpstudio.core.ranks.distributed import CheckpointReader

    storage = (
        CheckpointReader(checkpoints / "model.pt") if reader == "torch.save" else DCPReader(checkpoints / "dcp-one")
    )
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=storage, planner=DynamicMetaLoadPlanner(), no_dist=True)
    error = unwrap_error(caught.value)
    assert isinstance(error, DCPStudioError) and "\n" not in str(error)
    assert re.search(refusal, str(error)), str(error)
