"""Load a single-file checkpoint -- a torch.save file (or a directory of torch.save shards), or
safetensors (one file or sharded) -- straight into a multi-rank, sharded job with ``dcp.load``.

:class:`CheckpointReader` (alias :class:`TorchSaveReader`) replaces torch's
``BroadcastingTorchSaveReader``: the coordinator reads the checkpoint's structure safely (no tensor
data, no code from pickles), builds *global* metadata -- one whole chunk per tensor -- and
broadcasts it, so every rank plans its own shards against the same truth (DTensor targets on any
mesh, uneven splits, replicas, non-tensor values). In ``read_data``, ranks that see the same files
read their own regions; for the others the coordinator streams: a worker thread reads entry
``i + 1`` -- each distinct region once, by range (:mod:`.regions`) -- into one of two reused
buffers while entry ``i`` goes to every rank at once (:mod:`.transfer`), so it holds at most two
entries' regions. A failure on the coordinator is sent to every rank that still waits, so no rank
is left blocked.

Pair it with :class:`~dcpstudio.core.formats.dcp.planners.SafeLoadPlanner`::

    dcp.load(sd, storage_reader=CheckpointReader("model.safetensors"), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import os
import socket
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

from .. import errors
from ..checkpoints.opening import Checkpoint, TorchCheckpoint, open_checkpoint
from ..errors import DCPStudioError
from ..io.remote.locations import RemotePath, as_location
from .regions import Box, RegionReader, aligned, nbytes
from .transfer import Piece, apply, device, fail, post, rebuild_error, receive, target_bytes, wait

__all__ = ["CheckpointReader", "TorchSaveReader"]

_Request = tuple[int, int, Any]  # (rank, index in that rank's plan, (type, fqn, offsets, lengths))


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointReader(StorageReader):
    """A ``StorageReader`` for a torch.save or safetensors checkpoint, loaded into any sharding on
    any world size.

    With ``local_reads`` (the default), a rank that sees the very files the coordinator reads --
    same host, device, inode, size and modification time -- opens the checkpoint itself (safely,
    as the coordinator does) and reads its own regions, like the ranks of torch's
    ``FileSystemReader``; the others get their bytes from the coordinator. ``local_reads=False``
    streams every byte from the coordinator.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        *,
        coordinator_rank: int = 0,
        trust_pickle: bool = False,
        local_reads: bool = True,
    ) -> None:
        super().__init__()
        self.local_reads = local_reads
        self.path = as_location(checkpoint_id) if checkpoint_id is not None else None
        self.coordinator_rank = coordinator_rank
        self.trust_pickle = trust_pickle
        self.bytes_received = 0
        self.bytes_sent = 0
        self._ckpt: Checkpoint | None = None
        self._seen: tuple[Any, ...] | None = None  # the files' identity when the metadata was built
        self._dtypes: dict[str, torch.dtype] = {}
        self._straight: set[int] = set()  # the coordinator's own items, read straight into their targets
        self._order: list[str] = []
        self._metadata = Metadata(state_dict_metadata={})

    # -- StorageReader interface ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = as_location(checkpoint_id)
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
            raise rebuild_error(box[0][1], box[0][2])
        md: Metadata = box[0][1]
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._order = list(metadata.state_dict_metadata)
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rank, world = _dist()
        wanted = [(int(i.type.value), i.storage_index.fqn, _region(i), tuple(i.lengths)) for i in plan.items]
        try:
            if world == 1:
                self._serve([wanted], plan, planner, rank)
            else:
                idents: list[Any] = [None] * world
                mine = self._seen if rank == self.coordinator_rank else _identity(self.path)
                dist.all_gather_object(idents, mine if self.local_reads else None)
                local = rank != self.coordinator_rank and idents[rank] is not None
                local = local and idents[rank] == idents[self.coordinator_rank]
                gathered: list[Any] | None = [None] * world if rank == self.coordinator_rank else None
                dist.gather_object([] if local else wanted, gathered, dst=self.coordinator_rank)
                if rank == self.coordinator_rank:
                    assert gathered is not None
                    self._serve(gathered, plan, planner, rank)
                elif local:
                    self._serve([wanted], plan, planner, 0)
                else:
                    self.bytes_received += receive(plan, planner, self._metadata, self._order, self.coordinator_rank)
        finally:
            if self._ckpt is not None:
                self._ckpt.close()
                self._ckpt = None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- coordinator ------------------------------------------------------------------------------
    def _open(self) -> Checkpoint:
        if self.path is None:
            raise DCPStudioError("CheckpointReader needs a checkpoint_id (the torch.save or safetensors checkpoint)")
        ckpt = self._ckpt = open_checkpoint(self.path, trust_pickle=self.trust_pickle)
        if ckpt.format == "dcp":
            raise errors.UnsupportedFormatError(f"{self.path}: a DCP checkpoint; load it with DCPReader")
        if isinstance(ckpt, TorchCheckpoint) and ckpt.obj is not None and not isinstance(ckpt.obj, dict):
            raise errors.UnsupportedFormatError(f"{self.path}: holds a {type(ckpt.obj).__name__}, not a state dict")
        return ckpt

    def _build_metadata(self) -> Metadata:
        ckpt = self._open()
        self._seen = _identity(self.path)
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

    def _fetch(
        self,
        fqn: str,
        requests: list[_Request],
        slot: torch.Tensor,
        reader: RegionReader,
        plan: LoadPlan,
        planner: LoadPlanner,
        me: int,
    ) -> list[Piece]:
        """Read one entry for every rank; the other ranks' regions as bytes to send.

        Each distinct region is read once, by range (about its own bytes, not the whole tensor,
        when the format stores it in place), into ``slot``; the coordinator's own regions go
        straight into its target when they can. A non-tensor value is serialised once for all.
        """
        ckpt = self._ckpt
        assert ckpt is not None
        if ckpt.entries[fqn].kind != "tensor":
            buf = io.BytesIO()
            torch.save(ckpt.read_value(fqn), buf)
            raw = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
            for r, k, _ in requests:
                if r == me:
                    apply(plan.items[k], raw, planner, self._metadata)
            return [(r, k, raw) for r, k, _ in requests if r != me]
        dtype = self._dtypes[fqn]
        boxes: list[Box] = []
        regions: dict[tuple[Any, Any], torch.Tensor] = {}
        straight: list[tuple[int, torch.Tensor]] = []
        mine: list[Piece] = []
        out: list[Piece] = []
        at = 0
        for r, k, (_, _, offsets, lengths) in requests:
            if r == me and k in self._straight:
                target = planner.resolve_tensor(plan.items[k]).detach()
                boxes.append((offsets, lengths, target.view(tuple(lengths))))
                straight.append((k, target))
                continue
            region = regions.get((offsets, lengths))
            if region is None:
                n = nbytes(lengths, dtype)
                region = regions[offsets, lengths] = slot[at : at + n].view(dtype).view(lengths)
                boxes.append((offsets, lengths, region))
                at += aligned(n)
            (mine if r == me else out).append((r, k, region.reshape(-1).view(torch.uint8)))
        reader.read(fqn, boxes)
        for k, target in straight:
            planner.commit_tensor(plan.items[k], target)
        for _, k, payload in mine:
            apply(plan.items[k], payload, planner, self._metadata)
        return out

    def _serve(self, plans: Sequence[Sequence[Any]], plan: LoadPlan, planner: LoadPlanner, me: int) -> None:
        """Read entry ``i + 1`` on a worker thread while entry ``i`` is sent to every rank at once
        (``isend``). Entries alternate between two reused buffers, each as large as the most any
        one entry needs; the sends of ``i - 1`` are waited for before ``i + 1`` is read into its
        buffer. So the coordinator holds at most two entries' regions, whatever the checkpoint."""
        if self._ckpt is None:  # a rank reading for itself, or read_metadata ran on another instance
            self._open()
        ckpt = self._ckpt
        assert ckpt is not None
        self._dtypes = {f: e.dtype.torch for f, e in ckpt.entries.items() if e.kind == "tensor" and e.dtype}
        by_fqn: dict[str, list[_Request]] = {}
        for r, items in enumerate(plans):
            for k, item in enumerate(items):
                by_fqn.setdefault(item[1], []).append((r, k, item))
        order = [fqn for fqn in self._order if fqn in by_fqn]
        pending: dict[int, deque[int]] = {r: deque() for r in range(len(plans)) if r != me}
        for fqn in order:
            for r, n in Counter(r for r, _, _ in by_fqn[fqn] if r != me).items():
                pending[r].append(n)
        for r, left in pending.items():  # names the metadata lacks, which a rank waits for last (refused below)
            left.extend(Counter(i[1] for i in plans[r] if i[1] not in ckpt.entries).values())
        on = device()
        refused: Exception | None = None
        if self._seen is not None and _identity(self.path) != self._seen:  # replaced since the metadata was read
            refused = errors.CorruptCheckpointError(f"{self.path}: changed while it was being loaded; load it again")
        for fqn in by_fqn:
            refused = refused or _outside(ckpt, fqn, by_fqn[fqn], self.path)
        if refused is not None:
            fail(refused, [], pending, on)
            raise refused
        self._straight = {
            k for k, item in enumerate(plan.items) if target_bytes(item, planner, self._metadata, "cpu") is not None
        }
        most = 0
        for fqn in order:
            if fqn in self._dtypes:
                boxes = {(i[2], i[3]) for r, k, i in by_fqn[fqn] if r != me or k not in self._straight}
                most = max(most, sum(aligned(nbytes(b[1], self._dtypes[fqn])) for b in boxes))
        slots = [torch.empty(most, dtype=torch.uint8), torch.empty(most, dtype=torch.uint8)]
        sending: list[Any] = []
        reader = RegionReader(ckpt)

        if not any(pending.values()):  # nothing to send: no thread to hand entries over
            for i, fqn in enumerate(order):
                self._fetch(fqn, by_fqn[fqn], slots[i % 2], reader, plan, planner, me)
            return

        def fetch(i: int) -> Any:
            if i >= len(order):
                return None
            return pool.submit(self._fetch, order[i], by_fqn[order[i]], slots[i % 2], reader, plan, planner, me)

        with ThreadPoolExecutor(1, thread_name_prefix="dcpstudio-read") as pool:
            ahead = fetch(0)
            try:
                for i in range(len(order)):
                    pieces = ahead.result()
                    wait(sending)
                    ahead = fetch(i + 1)
                    sending, sent = post(pieces, me, on, pending)
                    self.bytes_sent += sent
                    del pieces
                wait(sending)
            except Exception as e:
                if ahead is not None:
                    ahead.cancel()
                fail(e, sending, pending, on)
                raise


def _region(item: ReadItem) -> tuple[int, ...]:
    """Where an item's region starts in the stored tensor: its chunk's offset plus its offsets in
    that chunk. Our metadata has one whole chunk per tensor, but a planner may plan against its
    own (torch's ``DynamicMetaLoadPlanner``: each rank's shards, each read at ``storage_offsets`` 0)."""
    base = item.storage_index.offset or ()
    return tuple(b + o for b, o in zip(base, item.storage_offsets, strict=False)) or tuple(item.storage_offsets)


def _outside(ckpt: Checkpoint, fqn: str, requests: list[_Request], path: Any) -> Exception | None:
    """A one-line refusal when some rank asks for elements of ``fqn`` the checkpoint does not store."""
    entry = ckpt.entries.get(fqn)
    for r, _, (kind, _, offsets, lengths) in requests:
        if entry is None or (kind == LoadItemType.TENSOR.value) != (entry.kind == "tensor"):
            what = "nothing" if entry is None else "a tensor" if entry.kind == "tensor" else "a value"
            asked = "a tensor" if kind == LoadItemType.TENSOR.value else "a value"
            return DCPStudioError(f"{path}: rank {r} asks for {fqn!r} as {asked}; the checkpoint holds {what} there")
        if entry.kind != "tensor":
            continue
        shape = tuple(entry.shape or ())
        if (
            len(offsets) != len(shape)
            or len(lengths) != len(shape)
            or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True))
        ):
            return DCPStudioError(
                f"{path}: rank {r} asks for {fqn!r} {list(lengths)} at {list(offsets)}; the checkpoint stores "
                f"a tensor of {list(shape)}"
            )
    return None


def _identity(path: Path | None) -> tuple[Any, ...] | None:
    """What two ranks compare to be sure they see the same files: host, and each file's device,
    inode, size and modification time; None when the files cannot be seen."""
    if path is None:
        return None
    try:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        stats = [(p.name, p.stat()) for p in files]
    except (OSError, DCPStudioError):
        return None
    if isinstance(path, RemotePath):  # an object store is the same for every host
        return (str(path), *((n, s.etag, s.st_size, s.st_mtime) for n, s in stats))
    return (socket.gethostname(), *((n, s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for n, s in stats))


TorchSaveReader = CheckpointReader  # the name of the first version, which read torch.save only
