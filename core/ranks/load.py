"""Test-load any checkpoint into any world size and layout, and check every rank's shards.

``load_rank`` runs on each rank (spawned by :func:`~dcpstudio.core.ranks.launch.launch` or started by
``torchrun``): it builds a target state dict of the requested layout from the checkpoint's
structure (allocating only local shards), loads it with ``dcp.load`` -- torch.save files through
:class:`~dcpstudio.core.ranks.distributed.TorchSaveReader`, DCP directories through
:class:`~dcpstudio.core.formats.dcp.files.DCPReader` -- and compares each local shard with the same
region read directly from the source.
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoints.opening import DCPCheckpoint, open_checkpoint
from ..dtypes import dtype_of
from ..formats.detect import detect_format
from ..io.blocks import box_slices
from ..io.remote.locations import RemotePath
from ..ops.compare.values import objects_equal
from ..ops.convert.layouts import LAYOUTS, parse_mesh, shard_dims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = ["LAYOUTS", "RankReport", "build_target", "load_rank", "parse_mesh", "placements"]


@dataclass
class RankReport:
    rank: int
    seconds: float
    bytes_received: int
    bytes_sent: int
    local_bytes: int
    peak_rss: int
    checked: int
    mismatches: list[str] = field(default_factory=list)
    startup: float = 0.0  # seconds before the load could begin: start, imports, process group (see load_rank)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def placements(layout: str, ndim: int, mesh_ndim: int) -> list[Placement]:
    """Placements of a tensor of ``ndim`` dimensions for ``layout`` on a 1-D or 2-D mesh (as
    :func:`~dcpstudio.core.ops.convert.layouts.shard_dims` gives them: the layouts' one definition)."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if d is None else Shard(d) for d in shard_dims(layout, ndim, mesh_ndim)]


def build_target(structure: dict[str, Any], layout: str, mesh: DeviceMesh) -> dict[str, Any]:
    """``structure`` maps fqn -> (dtype, shape) for tensors, None for other values."""
    from torch.distributed.tensor import empty as dtensor_empty

    target: dict[str, Any] = {}
    for fqn, spec in structure.items():
        if spec is None:
            target[fqn] = None
            continue
        dtype, shape = spec
        target[fqn] = dtensor_empty(
            shape, dtype=dtype_of(dtype).torch, device_mesh=mesh, placements=placements(layout, len(shape), mesh.ndim)
        )
    return target


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _steady_malloc() -> None:
    """Keep large blocks mmapped, so a rank's memory stays its shards plus the buffers in use.

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB); from then on
    blocks of a tensor's size come from the heap, and a rank that reads or receives tensor after
    tensor fragments it by tens of MiB. Setting the threshold (``M_MMAP_THRESHOLD``) fixes it."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)


def load_rank(
    rank: int,
    world: int,
    report: Callable[[str, float], None],
    path: str,
    layout: str,
    mesh_shape: Sequence[int],
    trust_pickle: bool = False,
    local_reads: bool = True,
) -> RankReport:
    """The per-rank job: structure (from rank 0), target, ``dcp.load``, check against the source.

    The report's ``startup`` is the time from :func:`~dcpstudio.core.ranks.launch.launch` until this rank
    had joined the process group, plus the imports below (none when the fork server preloaded
    them); under ``torchrun``, the imports only."""
    entered = time.perf_counter()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ..formats.dcp.planners import SafeLoadPlanner
    from ..formats.dcp.storage import DCPReader, unwrap_error
    from .distributed import TorchSaveReader
    from .launch import startup_seconds
    from .transfer import rebuild_error

    startup = (startup_seconds() or 0.0) + time.perf_counter() - entered
    _steady_malloc()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, tuple(mesh_shape))
    box: list[Any] = [None]
    with ExitStack() as opened:
        if rank == 0:  # a failure is broadcast too: every rank raises it instead of waiting forever
            try:
                ckpt = opened.enter_context(open_checkpoint(path, trust_pickle=trust_pickle))
                own = ckpt.own_entries() if isinstance(ckpt, DCPCheckpoint) else ckpt.entries
                structure = {f: (e.dtype, e.shape) if e.kind == "tensor" else None for f, e in own.items()}
                sidecars = [f for f in ckpt.entries if f not in own]
                box[0] = ("ok", structure, ckpt.format, sidecars)  # the format too: no rank detects it again
            except Exception as e:
                box[0] = ("error", type(e).__name__, str(e))
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise rebuild_error(box[0][1], box[0][2])
        fmt = box[0][2]
        if rank != 0:  # every rank checks its own shards against the source, opened once here
            ckpt = opened.enter_context(open_checkpoint(path, trust_pickle=trust_pickle, fmt=fmt))
        report("planned", 0.1)
        target = build_target(box[0][1], layout, mesh)
        is_dcp = fmt == "dcp"
        reader: Any = (
            DCPReader(path, trust_pickle=trust_pickle)
            if is_dcp
            else TorchSaveReader(path, trust_pickle=trust_pickle, local_reads=local_reads)
        )
        dist.barrier()  # the load time is the load's, not the wait for the slowest rank's target
        t0 = time.perf_counter()
        try:
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(trust_pickle=trust_pickle))
        except CheckpointException as e:
            raise unwrap_error(e) from None
        seconds = time.perf_counter() - t0
        report("loaded", 0.7)
        mismatches: list[str] = []
        local_bytes = 0
        # a DCP's sidecars (Megatron's common.pt, ...) are read by every rank, as their frameworks do
        target.update({fqn: ckpt.read_value(fqn) for fqn in box[0][3]})
        for fqn, value in target.items():
            if isinstance(value, DTensor):
                local = value.to_local()
                local_bytes += local.numel() * local.element_size()
                for chunk in value.__create_chunk_list__():
                    expected = ckpt.read_tensor(fqn, box_slices(chunk.offsets, chunk.sizes))
                    got = local.cpu()
                    if got.shape != expected.shape or not torch.equal(
                        got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
                    ):
                        mismatches.append(fqn)
            elif not objects_equal(value, ckpt.read_value(fqn)):
                mismatches.append(fqn)
        report("checked", 1.0)
        return RankReport(
            rank=rank,
            seconds=seconds,
            bytes_received=int(getattr(reader, "bytes_received", getattr(reader, "bytes_read", 0))),
            bytes_sent=int(getattr(reader, "bytes_sent", 0)),
            local_bytes=local_bytes,
            peak_rss=_peak_rss(),
            checked=len(target),
            mismatches=mismatches,
            startup=startup,
        )


def run_load(
    path: str | Path,
    *,
    ranks: int,
    layout: str = "shard0",
    mesh: str | None = None,
    timeout: float = 600.0,
    trust_pickle: bool = False,
    on_progress: Any = None,
    cancel: Any = None,
    local_reads: bool = True,
) -> list[RankReport]:
    """Start ``ranks`` local ranks and load ``path`` into ``layout``; per-rank reports.

    ``local_reads=False`` makes every rank get its bytes from the coordinator instead of reading
    the file itself (see :class:`~dcpstudio.core.ranks.distributed.CheckpointReader`)."""
    from .launch import launch

    shape = parse_mesh(mesh, ranks)
    if layout not in LAYOUTS:  # checked before any process starts
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    detect_format(path)
    return launch(
        load_rank,
        (path.url if isinstance(path, RemotePath) else str(path), layout, shape, trust_pickle, local_reads),
        nprocs=ranks,
        timeout=timeout,
        on_progress=on_progress,
        cancel=cancel,
    )
