"""Multi-rank DCP checkpoints made by torch itself (``dcp.save`` from several gloo ranks).

Run with the ``spawn`` start method, so the worker lives in an importable module.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "model.w": ((10, 6), torch.float32, "shard0"),  # 10 rows over 3 ranks: 4, 4, 2
    "model.v": ((5, 7), torch.float32, "shard1"),  # 7 columns over 3 ranks: 3, 3, 1
    "model.r": ((4, 4), torch.float32, "replicate"),
    "model.bf": ((9, 3), torch.bfloat16, "shard0"),
    "model.tiny": ((2, 3), torch.float32, "shard0"),  # fewer rows than ranks: one rank holds nothing
}


def full_tensor(name: str) -> torch.Tensor:
    shape, dtype, _ = SHAPES[name]
    n = 1
    for s in shape:
        n *= s
    seed = sum(map(ord, name))
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + seed).to(dtype)


def expected_state_dict() -> dict[str, Any]:
    model = {name.split(".", 1)[1]: full_tensor(name) for name in SHAPES}
    model["plain"] = torch.arange(6.0)
    return {"model": model, "step": 5, "extra": {"lr": 0.1, "tags": ["a", "b"]}}


def free_port() -> int:
    from dcpstudio.core.ranks.launch import free_port as pick

    return pick()


def _save_worker(rank: int, world: int, report: Any, out: str) -> None:
    """Runs under dcpstudio.core.ranks.launch.launch (process group already initialised)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
    sd = expected_state_dict()
    for name, (_, _, layout) in SHAPES.items():
        sd["model"][name.split(".", 1)[1]] = distribute_tensor(full_tensor(name), mesh, placements[layout])
    dcp.save(sd, checkpoint_id=out)


def save_multirank(out: Path, world: int = 3, timeout: float = 120.0) -> None:
    """Write a DCP checkpoint from ``world`` gloo ranks; fails (never hangs) within ``timeout``."""
    from dcpstudio.core.ranks.launch import launch

    launch(_save_worker, (str(out),), nprocs=world, timeout=timeout)


def _save_model_worker(rank: int, world: int, report: Any, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcpstudio.core.ops.demo import llama_like_state_dict

    mesh = init_device_mesh("cpu", (world,))
    sd = llama_like_state_dict(16 << 20)
    for name, t in sd["model"].items():
        sd["model"][name] = distribute_tensor(t, mesh, [Shard(0)] if t.dim() == 2 else [Replicate()])
    dcp.save(sd, checkpoint_id=out)


def save_sharded_model(out: Path, world: int = 3, timeout: float = 120.0) -> None:
    """A llama-like model saved by ``world`` ranks, matrices sharded by rows (for screenshots)."""
    from dcpstudio.core.ranks.launch import launch

    launch(_save_model_worker, (str(out),), nprocs=world, timeout=timeout)


def loadable_state_dict() -> dict[str, Any]:
    """Uneven shapes, bf16, 0-d and 1-d tensors, nested optimizer state, non-tensor values."""
    g = torch.Generator().manual_seed(11)
    return {
        "model": {
            "emb": torch.randn(13, 7, generator=g),  # 13 rows over 2/3/4 ranks: uneven
            "w": torch.randn(9, 10, generator=g).bfloat16(),
            "bias": torch.randn(5, generator=g),
            "scale": torch.tensor(0.5),
            "conv": torch.randn(6, 3, 2, 2, generator=g),
        },
        "optim": {
            "state": {"0": {"step": torch.tensor(7.0), "exp_avg": torch.randn(13, 7, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["0"]}],
        },
        "epoch": 4,
    }


def load_all_layouts(rank: int, world: int, report: Any, path: str, meshes: list[tuple[int, ...]]) -> list[Any]:
    """Every layout on every mesh shape, in one process group (one spawn per world size)."""
    from dcpstudio.core.ranks.load import LAYOUTS, load_rank

    out = []
    for mesh in meshes:
        for layout in LAYOUTS:
            out.append((layout, mesh, load_rank(rank, world, report, path, layout, mesh)))
    return out


def die_midway(rank: int, world: int, report: Any, path: str) -> None:
    """Rank 1 kills itself with SIGKILL while the others wait in a collective."""
    import signal

    import torch.distributed as dist

    if rank == 1:
        Path(f"{path}.killed-at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def raise_on_rank(rank: int, world: int, report: Any, path: str) -> None:
    import torch.distributed as dist

    if rank == world - 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()


def hang_on_rank(rank: int, world: int, report: Any, path: str) -> None:
    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def mixed_state_dict(n: int = 48) -> dict[str, Any]:
    """Many entries of every common dtype, uneven shapes (rows and columns that do not split
    evenly over 3 ranks, 0-d, empty), with non-tensor values between the tensors."""
    g = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]
    shapes = [(7, 5), (10, 3), (2, 11), (13,), (), (5, 4, 3), (1, 9), (0, 4)]
    sd: dict[str, Any] = {}
    for i in range(n):
        dtype, shape = dtypes[i % len(dtypes)], shapes[i % len(shapes)]
        t = torch.randn(shape, generator=g) * 50
        sd[f"t{i:02d}"] = t > 0 if dtype == torch.bool else t.to(dtype)
        if i % 9 == 4:
            sd[f"name{i:02d}"], sd[f"scale{i:02d}"] = f"entry {i}", i / 3
    return sd


def load_mixed(rank: int, world: int, report: Any, path: str, local_reads: bool) -> dict[str, Any]:
    """Load ``path`` through CheckpointReader into shard1 DTensors (regions strided in the file),
    except every third tensor, which goes into a full float64 plain tensor (a dtype cast on copy);
    return the entries that differ from the source."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.ranks.distributed import CheckpointReader
    from dcpstudio.core.ranks.load import build_target

    source = torch.load(path, weights_only=True)
    mesh = init_device_mesh("cpu", (world,))
    structure = {
        f: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for f, v in source.items() if torch.is_tensor(v)
    }
    target: dict[str, Any] = build_target(structure, "shard1", mesh)
    for i, fqn in enumerate(sorted(structure)):
        if i % 3 == 0:
            target[fqn] = torch.full(source[fqn].shape, -1.0, dtype=torch.float64)
    target.update({f: None for f in source if f not in structure})
    reader = CheckpointReader(path, local_reads=local_reads)
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    wrong = []
    for fqn, want in source.items():
        got = target[fqn]
        if isinstance(got, DTensor):
            got = got.full_tensor()
        if torch.is_tensor(want):
            same = torch.equal(got, want.to(got.dtype)) and got.shape == want.shape
        else:
            same = got == want
        if not same:
            wrong.append(fqn)
    return {"wrong": wrong, "received": reader.bytes_received, "sent": reader.bytes_sent}


def coordinator_fails_midway(rank: int, world: int, report: Any, path: str, at: int) -> str:
    """The coordinator fails while reading entry ``at``; every rank returns the error it got."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpstudio.core.errors import CorruptCheckpointError
    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.formats.dcp.storage import unwrap_error
    from dcpstudio.core.ranks.distributed import CheckpointReader

    source = torch.load(path, weights_only=True)
    target = {f: torch.empty_like(v) if torch.is_tensor(v) else None for f, v in source.items()}
    reader = CheckpointReader(path, local_reads=False)
    real = reader._fetch
    seen: list[str] = []

    def failing(fqn: str, *args: Any) -> Any:
        seen.append(fqn)
        if len(seen) > at:
            raise CorruptCheckpointError(f"cannot read {fqn} (on purpose)")
        return real(fqn, *args)

    reader._fetch = failing  # type: ignore[method-assign]
    try:
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:
        error = unwrap_error(e)
        return f"{type(error).__name__}: {error}"
    return "no error"


def receiver_fails_midway(rank: int, world: int, report: Any, path: str, who: int, at: int) -> str:
    """Rank ``who`` refuses the bytes of the ``at``-th tensor it commits (its target rejects them);
    every rank returns the error it got."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.formats.dcp.storage import unwrap_error
    from dcpstudio.core.ranks.distributed import CheckpointReader

    committed: list[str] = []

    class Refusing(SafeLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            committed.append(read_item.storage_index.fqn)
            if rank == who and len(committed) > at:
                raise ValueError(f"rank {rank} refuses {read_item.storage_index.fqn} (on purpose)")
            super().commit_tensor(read_item, tensor)

    source = torch.load(path, weights_only=True)
    target = {f: torch.empty_like(v) if torch.is_tensor(v) else None for f, v in source.items()}
    try:
        dcp.load(target, storage_reader=CheckpointReader(path, local_reads=False), planner=Refusing())
    except CheckpointException as e:
        error = unwrap_error(e)
        return f"{type(error).__name__}: {error}"
    return "no error"


def file_replaced_after_metadata(rank: int, world: int, report: Any, path: str, spare: str) -> str:
    """Rank 0 replaces the checkpoint (``os.replace`` of another file) right after building the
    metadata; every rank returns the error it got, or what it loaded."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.formats.dcp.storage import unwrap_error
    from dcpstudio.core.ranks.distributed import CheckpointReader

    source = torch.load(path, weights_only=True)
    target = {f: torch.empty_like(v) if torch.is_tensor(v) else None for f, v in source.items()}
    reader = CheckpointReader(path)
    real = reader._build_metadata

    def then_replace() -> Any:
        md = real()
        os.replace(spare, path)
        return md

    reader._build_metadata = then_replace  # type: ignore[method-assign]
    try:
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:
        error = unwrap_error(e)
        return f"{type(error).__name__}: {error}"
    return "loaded " + (
        "the old values"
        if all(torch.equal(target[f], v) for f, v in source.items() if torch.is_tensor(v))
        else "other values"
    )


_OPENED: list[str] | None = None  # data files opened while a count is on (see data_files_opened)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        name = os.fsdecode(args[0])
        if name.endswith(".distcp"):
            _OPENED.append(os.path.basename(name))


def data_files_opened(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``fn(*args, **kwargs)``, and the ``.distcp`` files opened meanwhile, in order with repeats, as Python's
    ``open`` audit event reports them (``open()``, ``os.open``, ``pathlib``: whatever reader runs)."""
    global _OPENED
    if not getattr(data_files_opened, "hooked", False):
        import sys

        sys.addaudithook(_audit)  # hooks cannot be removed: one per process, gated by _OPENED
        data_files_opened.hooked = True  # type: ignore[attr-defined]
    _OPENED = []
    try:
        return fn(*args, **kwargs), _OPENED
    finally:
        _OPENED = None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def load_resharded(
    rank: int, world: int, report: Any, path: str, layout: str, mesh_shape: tuple[int, ...], reference: str
) -> dict[str, Any]:
    """torch's own ``dcp.load`` (FileSystemReader, DefaultLoadPlanner) of ``path`` into DTensors of
    ``layout``: the files each load opens (the whole state dict; its tensors alone), the entries
    whose values differ from :func:`expected_state_dict`; then torch's ``dcp.save`` of the same
    DTensors to ``reference``, the layout torch writes for them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.pickles.tree import flatten_state_dict
    from dcpstudio.core.ranks.load import build_target

    mesh = init_device_mesh("cpu", mesh_shape)
    with open_checkpoint(path) as ckpt:
        structure = {f: (e.dtype, e.shape) if e.kind == "tensor" else None for f, e in ckpt.entries.items()}
    want, _ = flatten_state_dict(expected_state_dict())
    target = build_target(structure, layout, mesh)
    _, opened = data_files_opened(dcp.load, target, checkpoint_id=path)
    tensors = build_target({f: s for f, s in structure.items() if s is not None}, layout, mesh)
    _, tensors_opened = data_files_opened(dcp.load, tensors, checkpoint_id=path)
    wrong = []
    for fqn, value in target.items():
        if isinstance(value, DTensor):
            same = True
            for chunk in value.__create_chunk_list__():
                region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
                expected = want[fqn][region]
                local = value.to_local()
                same = same and local.dtype == expected.dtype and torch.equal(_bits(local), _bits(expected))
            same = same and torch.equal(tensors[fqn].to_local(), value.to_local())
        else:
            same = value == want[fqn]
        if not same:
            wrong.append(fqn)
    dcp.save(target, checkpoint_id=reference)
    return {
        "opened": sorted(set(opened)),
        "tensors_opened": sorted(set(tensors_opened)),
        "wrong": wrong,
        "opens": len(opened),
    }


class _NoDedupPlanner:
    """A ``DefaultSavePlanner`` that keeps every rank's copy of a replicated tensor (torch's own
    dedups them, keeping one rank's, and refuses overlapping chunks in its global plan -- both
    skipped here): what a custom planner, or two jobs writing into one directory, leave behind."""

    def __new__(cls) -> Any:
        import torch.distributed.checkpoint.default_planner as planner

        class NoDedup(planner.DefaultSavePlanner):
            def _dedup_save_plans(self, all_plans: list[Any]) -> list[Any]:
                return all_plans

        planner._validate_global_plan = lambda *args: []  # type: ignore[attr-defined] # this process only
        return NoDedup()


def _save_divergent_worker(rank: int, world: int, report: Any, out: str) -> None:
    """Every rank saves ``r``, a replicated DTensor whose replicas diverged (each rank's own
    values), undeduplicated, and a row-sharded ``w``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    r = DTensor.from_local(torch.full((4, 4), float(rank + 1)), mesh, [Replicate()], run_check=False)
    sd = {"r": r, "w": distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])}
    dcp.save(sd, checkpoint_id=out, planner=_NoDedupPlanner())


def save_divergent_replica(out: Path, world: int = 2, timeout: float = 120.0) -> None:
    """A DCP in which replicated ``r`` was written by every rank with different values."""
    from dcpstudio.core.ranks.launch import launch

    launch(_save_divergent_worker, (str(out),), nprocs=world, timeout=timeout)
