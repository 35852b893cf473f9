"""Checkpoints made by the real writers of the ecosystem, as the torch in the test environment has
them: FSDP2 with AdamW saved through ``thread_count>1`` and ``async_save``, torch's
``HuggingFaceStorageWriter`` (one process, and distributed), ``FileSystemWriter`` with
``serialization_format=SAFETENSORS``. Each maker writes the checkpoint and, next to it, what torch's
own reader makes of it (``reference.pt``) -- or the state dict it saved, where torch has no reader.
Rank workers run under dcpstudio.core.ranks.launch (spawned, gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.conftest import dcp_load, dcp_save


def has(module: str, name: str) -> bool:
    import importlib

    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(11, 6, generator=g),
        "model.layers.0.mlp.weight": torch.randn(7, 6, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(6, generator=g),
        "lm_head.weight": torch.randn(11, 6, generator=g),
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.ReLU(), torch.nn.Linear(9, 5))


def _fsdp2_worker(rank: int, world: int, report: Any, out: str, threads: int, use_async: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95))
    model(torch.ones(4, 12)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    writer = FileSystemWriter(out, thread_count=threads)
    state = {"model": msd, "optim": osd, "step": 1}
    if use_async:
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)
    full_m, full_o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o, "step": 1}, Path(out).with_name("reference.pt"))
    dist.barrier()


def fsdp2_adamw(out: Path, *, threads: int = 2, use_async: bool = True) -> Path:
    from dcpstudio.core.ranks.launch import LaunchError, launch

    try:
        launch(_fsdp2_worker, (str(out), threads, use_async), nprocs=2, timeout=240)
    except LaunchError as e:
        if "record_event" in str(e):  # FSDP2 on CPU and gloo needs torch >= 2.7
            import pytest

            pytest.skip(f"this torch ({torch.__version__}) cannot run FSDP2 on CPU: {e}")
        raise
    return out


def _hf_distributed_worker(rank: int, world: int, report: Any, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(v, mesh, [Shard(0)] if v.dim() == 2 else [Replicate()]) for k, v in full_tensors().items()
    }
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))


def hf_distributed(out: Path) -> Path:
    """torch's HuggingFaceStorageWriter(save_distributed=True): one shard file per rank, each
    holding that rank's rows under the full names (transformers 5's distributed layout)."""
    from dcpstudio.core.ranks.launch import launch

    launch(_hf_distributed_worker, (str(out),), nprocs=2, timeout=240)
    return out


def hf_single(out: Path) -> Path:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    names = list(full_tensors())
    mapping = {name: 1 + i % 2 for i, name in enumerate(names)}
    dcp_save(full_tensors(), storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=mapping))
    return out


def safetensors_serialized_dcp(out: Path) -> Path:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = {"model": full_tensors(), "step": 4, "betas": (0.9, 0.95)}
    writer = FileSystemWriter(str(out), serialization_format=SerializationFormat.SAFETENSORS)
    dcp_save(state, storage_writer=writer)
    torch.save(state, out.with_name("reference.pt"))
    return out


def read_hf_with_torch(path: Path) -> dict[str, torch.Tensor]:
    """What torch's HuggingFaceStorageReader loads: full tensors, in one process."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sd = {k: torch.empty_like(v) for k, v in full_tensors().items()}
    dcp_load(sd, storage_reader=HuggingFaceStorageReader(str(path)))
    return sd
