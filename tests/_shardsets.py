"""Per-rank ``torch.save`` shard sets made by torch itself: each gloo rank saves ``model_{rank}.pt``
of a state dict of DTensors (``distribute_tensor`` on a 1-D and a 2-D mesh, FSDP2 ``fully_shard``).

Run with the ``spawn`` start method, so the worker lives in an importable module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WORLD = 4


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors every set shards (uneven shapes, bf16, 0-d)."""
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(10, 6, generator=g),  # 10 rows over 4 ranks: 3, 3, 3, 1
        "v": torch.randn(5, 7, generator=g).bfloat16(),
        "r": torch.randn(4, generator=g),
        "t": torch.randn(3, 2, generator=g),  # fewer rows than ranks
        "s": torch.tensor(1.5),
    }


def _mesh1d(full: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    layout = {"w": [Shard(0)], "v": [Shard(1)], "r": [Replicate()], "t": [Shard(0)], "s": [Replicate()]}
    return {name: distribute_tensor(t, mesh, layout[name]) for name, t in full.items()}


def _mesh2d(full: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    layout = {
        "w": [Shard(0), Shard(1)],
        "v": [Replicate(), Shard(0)],
        "r": [_StridedShard(0, split_factor=2), Shard(0)],
        "t": [Shard(1), Shard(0)],
        "s": [Replicate(), Replicate()],
    }
    out: dict[str, Any] = {}
    for name, t in full.items():
        placements = layout[name]
        if isinstance(placements[0], _StridedShard):  # as FSDP2 + TP lay it out: TP first, then FSDP
            from torch.distributed.tensor import DTensor

            tp = t.chunk(mesh.size(1), dim=0)[mesh.get_local_rank(1)]
            local = tp.chunk(mesh.size(0), dim=0)[mesh.get_local_rank(0)].clone()
            out[name] = DTensor.from_local(local, mesh, placements, shape=t.shape, stride=t.stride(), run_check=False)
        else:
            out[name] = distribute_tensor(t, mesh, placements)
    return out


def _save_sets(rank: int, world: int, report: Any, root: str) -> None:
    """Runs under dcpstudio.core.ranks.launch.launch (process group already initialised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    full = full_tensors()
    one = init_device_mesh("cpu", (world,))
    sd = {"model": _mesh1d(full, one), "step": 7, "plain": torch.arange(3.0)}
    Path(root, "mesh1d").mkdir(exist_ok=True)
    torch.save(sd, f"{root}/mesh1d/model_{rank}.pt")
    two = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    Path(root, "mesh2d").mkdir(exist_ok=True)
    torch.save(_mesh2d(full, two), f"{root}/mesh2d/model_{rank}.pt")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    fully_shard(model, mesh=one)
    Path(root, "fsdp2").mkdir(exist_ok=True)
    torch.save(model.state_dict(), f"{root}/fsdp2/model_{rank}.pt")
    _save_bad(rank, root, one, full["w"])


def _save_bad(rank: int, root: str, mesh: Any, w: torch.Tensor) -> None:
    """``mismatch``: rank 1 declares another global shape; ``partial``: a pending reduction."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    good = distribute_tensor(w, mesh, [Shard(0)])
    shape = (11, 6) if rank == 1 else tuple(w.shape)
    bad = DTensor.from_local(good.to_local(), mesh, [Shard(0)], shape=shape, stride=(6, 1), run_check=False)
    for name, sd in (("mismatch", {"w": bad}), ("partial", {"w": DTensor.from_local(w, mesh, [Partial()])})):
        Path(root, name).mkdir(exist_ok=True)
        torch.save(sd, f"{root}/{name}/model_{rank}.pt")


def fsdp2_full() -> dict[str, torch.Tensor]:
    """The full state dict of :func:`_save_sets`' FSDP2 model (the same seed, unsharded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_shard_sets(root: Path, timeout: float = 120.0) -> None:
    """``root/mesh1d``, ``root/mesh2d`` and ``root/fsdp2``: ``model_{rank}.pt`` from :data:`WORLD` ranks."""
    from dcpstudio.core.ranks.launch import launch

    launch(_save_sets, (str(root),), nprocs=WORLD, timeout=timeout)
