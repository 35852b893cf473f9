"""Load a single-file checkpoint -- a torch.save file (or a directory of torch.save shards), or
safetensors (one file or sharded) -- straight into a multi-rank, sharded job with ``dcp.load``.

:class:`CheckpointReader` (alias :class:`TorchSaveReader`) replaces torch's
``BroadcastingTorchSaveReader``: the coordinator reads the checkpoint's structure safely (no tensor
data, no code from pickles), builds *global* metadata -- one whole chunk per tensor -- and
broadcasts it, so every rank plans its own shards against the same truth (DTensor targets on any
mesh, uneven splits, replicas, non-tensor values). In ``read_data`` the coordinator learns every
rank's read items, reads one tensor at a time (by range, from any format) and sends each rank only
the bytes of its own regions, point to point. A failure on the coordinator is sent to every rank
that still waits, so no rank is left blocked.

Pair it with :class:`~dcpstudio.core.planners.SafeLoadPlanner`::

    dcp.load(sd, storage_reader=CheckpointReader("model.safetensors"), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import errors
from ._io import tensor_buffer
from .errors import DCPStudioError
from .inspect import Checkpoint, TorchCheckpoint, open_checkpoint

__all__ = ["CheckpointReader", "TorchSaveReader"]

_OK, _FAILED = 0, 1


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _rebuild_error(kind: str, message: str) -> Exception:
    cls = getattr(errors, kind, None)
    return cls(message) if isinstance(cls, type) and issubclass(cls, Exception) else DCPStudioError(message)


class CheckpointReader(StorageReader):
    """A ``StorageReader`` for a torch.save or safetensors checkpoint, loaded into any sharding on
    any world size."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        *,
        coordinator_rank: int = 0,
        trust_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.path = Path(checkpoint_id) if checkpoint_id is not None else None
        self.coordinator_rank = coordinator_rank
        self.trust_pickle = trust_pickle
        self.bytes_received = 0
        self.bytes_sent = 0
        self._ckpt: Checkpoint | None = None
        self._order: list[str] = []

    # -- StorageReader interface ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.bytes_received = self.bytes_sent = 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.exists(checkpoint_id)

    def read_metadata(self) -> Metadata:
        """Built on the coordinator and broadcast; every rank gets the same metadata (or error)."""
        rank, world = _dist()
        box: list[Any] = [None]
        if rank == self.coordinator_rank:
            try:
                box[0] = ("ok", self._build_metadata())
            except Exception as e:
                box[0] = ("error", type(e).__name__, str(e))
        if world > 1:
            dist.broadcast_object_list(box, src=self.coordinator_rank)
        if box[0][0] == "error":
            raise _rebuild_error(box[0][1], box[0][2])
        md: Metadata = box[0][1]
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._order = list(metadata.state_dict_metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rank, world = _dist()
        wanted = [
            (int(i.type.value), i.storage_index.fqn, tuple(i.storage_offsets), tuple(i.lengths)) for i in plan.items
        ]
        try:
            if world == 1:
                self._serve([wanted], plan, planner, rank)
            else:
                gathered: list[Any] | None = [None] * world if rank == self.coordinator_rank else None
                dist.gather_object(wanted, gathered, dst=self.coordinator_rank)
                if rank == self.coordinator_rank:
                    assert gathered is not None
                    self._serve(gathered, plan, planner, rank)
                else:
                    self._receive(plan, planner)
        finally:
            if self._ckpt is not None:
                self._ckpt.close()
                self._ckpt = None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- coordinator ------------------------------------------------------------------------------
    def _build_metadata(self) -> Metadata:
        if self.path is None:
            raise DCPStudioError("CheckpointReader needs a checkpoint_id (the torch.save or safetensors checkpoint)")
        ckpt = self._ckpt = open_checkpoint(self.path, trust_pickle=self.trust_pickle)
        if ckpt.format == "dcp":
            raise errors.UnsupportedFormatError(f"{self.path}: a DCP checkpoint; load it with DCPReader")
        if isinstance(ckpt, TorchCheckpoint) and ckpt.obj is not None and not isinstance(ckpt.obj, dict):
            raise errors.UnsupportedFormatError(f"{self.path}: holds a {type(ckpt.obj).__name__}, not a state dict")
        sdm: dict[str, Any] = {}
        for fqn, entry in ckpt.entries.items():
            if entry.kind == "tensor":
                assert entry.dtype is not None
                shape = entry.shape or ()
                zeros, size = torch.Size([0] * len(shape)), torch.Size(shape)
                sdm[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=entry.dtype.torch), size, [ChunkStorageMetadata(zeros, size)]
                )
            else:
                sdm[fqn] = BytesStorageMetadata()
        storage = {MetadataIndex(fqn): fqn for fqn in sdm}
        return Metadata(state_dict_metadata=sdm, storage_data=storage)

    def _payload(self, fqn: str, item: Any, full: Any) -> torch.Tensor:
        kind, _, offsets, lengths = item
        if kind == LoadItemType.BYTE_IO.value:
            buf = io.BytesIO()
            torch.save(full, buf)
            return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        region = narrow_tensor_by_index(full, offsets, lengths).contiguous()
        return region.reshape(-1).view(torch.uint8) if region.numel() else torch.empty(0, dtype=torch.uint8)

    def _serve(self, plans: Sequence[Sequence[Any]], plan: LoadPlan, planner: LoadPlanner, me: int) -> None:
        if self._ckpt is None:  # read_metadata ran on another instance or reset() was called
            self._build_metadata()
        ckpt = self._ckpt
        assert ckpt is not None
        by_fqn: dict[str, list[tuple[int, int, Any]]] = {}
        for r, items in enumerate(plans):
            for k, item in enumerate(items):
                by_fqn.setdefault(item[1], []).append((r, k, item))
        pending = {r: len(items) for r, items in enumerate(plans)}
        device = _device()
        try:
            for fqn in self._order:
                requests = by_fqn.get(fqn)
                if not requests:
                    continue
                full = ckpt.read_value(fqn)  # one tensor in memory at a time
                for r, k, item in requests:
                    payload = self._payload(fqn, item, full)
                    if r == me:
                        self._apply(plan.items[k], payload, planner)
                    else:
                        dist.send(torch.tensor([_OK, payload.numel()], dtype=torch.int64, device=device), dst=r)
                        dist.send(payload.to(device), dst=r)
                        self.bytes_sent += payload.numel()
                    pending[r] -= 1
                    del payload
                del full  # before the next tensor is read: one whole tensor in memory at a time
        except Exception as e:
            note = f"{type(e).__name__}\n{e}".encode()[:4000]
            for r, left in pending.items():
                if r != me and left > 0:
                    dist.send(torch.tensor([_FAILED, len(note)], dtype=torch.int64, device=device), dst=r)
                    dist.send(torch.frombuffer(bytearray(note), dtype=torch.uint8).to(device), dst=r)
            raise

    # -- other ranks ------------------------------------------------------------------------------
    def _receive(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        position = {fqn: i for i, fqn in enumerate(self._order)}
        order = sorted(range(len(plan.items)), key=lambda k: (position.get(plan.items[k].storage_index.fqn, -1), k))
        device = _device()
        for k in order:
            header = torch.empty(2, dtype=torch.int64, device=device)
            dist.recv(header, src=self.coordinator_rank)
            status, nbytes = (int(x) for x in header.tolist())
            payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.recv(payload, src=self.coordinator_rank)
            if status != _OK:
                kind, _, message = bytes(payload.cpu().tolist()).decode(errors="replace").partition("\n")
                raise _rebuild_error(kind, f"coordinator failed: {message}")
            self.bytes_received += nbytes
            self._apply(plan.items[k], payload.cpu(), planner)

    @staticmethod
    def _apply(item: ReadItem, payload: torch.Tensor, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(tensor_buffer(payload.contiguous()))))
            return
        target = planner.resolve_tensor(item).detach()
        source = payload.view(_dtype_of(planner, item)).reshape(tuple(item.lengths))
        target.copy_(source)
        planner.commit_tensor(item, target)


def _dtype_of(planner: LoadPlanner, item: ReadItem) -> torch.dtype:
    md = getattr(planner, "metadata", None)
    tmd = md.state_dict_metadata[item.storage_index.fqn] if md is not None else None
    if not isinstance(tmd, TensorStorageMetadata):
        raise DCPStudioError(f"no tensor metadata for {item.storage_index.fqn}")
    return tmd.properties.dtype


TorchSaveReader = CheckpointReader  # the name of the first version, which read torch.save only
