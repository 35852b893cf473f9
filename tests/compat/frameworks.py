"""Checkpoints written by training frameworks that are not test dependencies (each maker is used only
when its framework is installed): Megatron-Core's ``torch_dist`` (``dist_checkpointing.save``, two
ranks: ``.metadata`` with ``all_local_plans``, ``common.pt``, ``metadata.json``, ``ShardedObject`` byte
items) and Lightning Fabric's sharded save (DCP + ``meta.pt``). Next to each, ``reference.pt``: what
the framework's own loader gives back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPE = (8, 4)


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"decoder.weight": torch.randn(*SHAPE, generator=g), "decoder.bias": torch.randn(8, generator=g).bfloat16()}


def _megatron_worker(rank: int, world: int, report: Any, out: str) -> None:
    # megatron-core 0.16 calls these on its save path even for CPU tensors; torch's CPU build raises
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = _full()
    rows = SHAPE[0] // world

    def sharded(load: bool) -> dict[str, Any]:
        w = torch.empty(SHAPE) if load else full["decoder.weight"][rank * rows : (rank + 1) * rows].clone()
        weight = (
            ShardedTensor.from_rank_offsets("decoder.weight", w, replica_id=rank)
            if load
            else ShardedTensor.from_rank_offsets("decoder.weight", w, (0, rank, world))
        )
        bias = torch.empty(8, dtype=torch.bfloat16) if load else full["decoder.bias"].clone()
        rng = {"random_rng_state": [rank, 7], "torch_rng_state": torch.arange(4) + rank}
        state = {
            "model": {
                "decoder.weight": weight,
                "decoder.bias": ShardedTensor.from_rank_offsets("decoder.bias", bias, replica_id=rank),
            },
            "rng_state": ShardedObject("rng_state", None if load else rng, (world,), (rank,), replica_id=0),
        }
        if not load:
            state.update(iteration=7, args={"lr": 0.5, "name": "gpt"}, extra_tensor=torch.ones(2).half())
        return state

    dist_checkpointing.save(sharded(load=False), out)
    dist.barrier()
    loaded = dist_checkpointing.load(sharded(load=True), out)
    if rank == 0:
        torch.save(loaded, Path(out).with_name("reference.pt"))
    dist.barrier()


def _megatron_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _megatron_worker(rank, world, None, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(target: Any, args_of: Any, n: int, timeout: float) -> None:
    """``n`` spawned, non-daemonic processes (the frameworks start children of their own)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(k)) for k in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def megatron_torch_dist(out: Path) -> Path:
    out.mkdir(parents=True)
    port = _free_port()
    _spawned(_megatron_rank, lambda k: (k, 2, port, str(out)), 2, 300)
    return out


def _lightning_worker(out: str, port: int) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # Fabric's one-process group
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    fabric = Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(parallelize_fn=parallelize))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(torch.nn.Linear(4, 3))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer, "step": 5, "hparams": {"lr": 0.1}, "t": torch.arange(3)}
    fabric.save(out, state)
    fresh = fabric.setup_module(torch.nn.Linear(4, 3))
    back = {"model": fresh}
    rest = fabric.load(out, back)  # Lightning's own reader: the weights into the module, meta.pt's state
    weights = {f"model.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fresh.state_dict().items()}
    torch.save({**weights, **{k: v for k, v in rest.items() if k != "optimizer"}}, Path(out).with_name("reference.pt"))


def lightning_sharded(out: Path) -> Path:
    """Fabric's ``ModelParallelStrategy`` (FSDP2) sharded save, one CPU process: DCP plus ``meta.pt``
    (Lightning's FSDP1 strategy refuses the CPU)."""
    port = _free_port()
    _spawned(_lightning_worker, lambda k: (str(out), port), 1, 240)
    return out
