"""A torchtitan ``torch_checkpointing`` checkpoint written by the real package: two gloo ranks save
an FSDP2 model's and its Adam optimizer's state dicts (DTensors) through
``torch_checkpointing.CheckpointManager``, the items declared with a resharder as torchtitan's
backend declares them (which makes rank 0 write ``metadata.pkl``). On CPU, three changes:
synchronous saving (the default async saver stages into pinned memory); the metadata all-gather
done with ``all_gather_object`` (torch_checkpointing 0.1.1 puts its gather buffers on ``cuda``
unconditionally); buffered writes (``O_DIRECT`` writes of unaligned lengths fail with EINVAL on
ext4). The files written are the package's own.

Run with the ``spawn`` start method, so the worker lives in an importable module.
"""

from __future__ import annotations

from typing import Any

import torch

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _gather_on_cpu(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, data, group=process_group)
    return dict(enumerate(out))


def _save(rank: int, world: int, report: Any, path: str) -> None:
    """Runs under dcpstudio.core.ranks.launch.launch (process group already initialised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.metadata_manager import DefaultMetadataManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    DefaultMetadataManager._all_gather_pickled_data = _gather_on_cpu  # type: ignore[method-assign]

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    spec = ItemSpec(requires_copy=True, resharder=DefaultResharder(), required=False)
    config = CheckpointManager.Config(
        items={"model": spec, "optimizer": spec},
        default=ItemSpec(requires_copy=False),
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    manager = config.build()
    try:
        manager.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3})
    finally:
        manager.close()


def save_torch_checkpointing(path: str, timeout: float = 120.0) -> None:
    """``path``: the folder ``CheckpointManager.save`` writes from :data:`WORLD` ranks."""
    from dcpstudio.core.ranks.launch import launch

    launch(_save, (path,), nprocs=WORLD, timeout=timeout)


def expected() -> dict[str, torch.Tensor]:
    """The model's full parameters before the step (the optimizer changes them; tests read shapes)."""
    return {k: v.detach().clone() for k, v in _model().state_dict().items()}
