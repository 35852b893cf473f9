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

import contextlib
import io
import os
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

from . import errors
from ._io import tensor_buffer
from ._regions import Box, RegionReader, aligned, nbytes
from .errors import DCPStudioError
from .inspect import Checkpoint, TorchCheckpoint, open_checkpoint

__all__ = ["CheckpointReader", "TorchSaveReader"]

_OK, _FAILED = 0, 1

_Request = tuple[int, int, Any]  # (rank, index in that rank's plan, (type, fqn, offsets, lengths))
_Piece = tuple[int, int, torch.Tensor]  # (rank, index in that rank's plan, the item's bytes)


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
        self._dtypes: dict[str, torch.dtype] = {}
        self._straight: set[int] = set()  # the coordinator's own items, read straight into their targets
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

    def _fetch(
        self,
        fqn: str,
        requests: list[_Request],
        slot: torch.Tensor,
        reader: RegionReader,
        plan: LoadPlan,
        planner: LoadPlanner,
        me: int,
    ) -> list[_Piece]:
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
                    self._apply(plan.items[k], raw, planner)
            return [(r, k, raw) for r, k, _ in requests if r != me]
        dtype = self._dtypes[fqn]
        boxes: list[Box] = []
        regions: dict[tuple[Any, Any], torch.Tensor] = {}
        straight: list[tuple[int, torch.Tensor]] = []
        mine: list[_Piece] = []
        out: list[_Piece] = []
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
            self._apply(plan.items[k], payload, planner)
        return out

    def _serve(self, plans: Sequence[Sequence[Any]], plan: LoadPlan, planner: LoadPlanner, me: int) -> None:
        """Read entry ``i + 1`` on a worker thread while entry ``i`` is sent to every rank at once
        (``isend``). Entries alternate between two reused buffers, each as large as the most any
        one entry needs; the sends of ``i - 1`` are waited for before ``i + 1`` is read into its
        buffer. So the coordinator holds at most two entries' regions, whatever the checkpoint."""
        if self._ckpt is None:  # read_metadata ran on another instance or reset() was called
            self._build_metadata()
        ckpt = self._ckpt
        assert ckpt is not None
        self._dtypes = {f: e.dtype.torch for f, e in ckpt.entries.items() if e.kind == "tensor" and e.dtype}
        by_fqn: dict[str, list[_Request]] = {}
        for r, items in enumerate(plans):
            for k, item in enumerate(items):
                by_fqn.setdefault(item[1], []).append((r, k, item))
        order = [fqn for fqn in self._order if fqn in by_fqn]
        self._straight = {k for k, item in enumerate(plan.items) if _target_bytes(item, planner, "cpu") is not None}
        pending: dict[int, deque[int]] = {r: deque() for r in range(len(plans)) if r != me}
        most = 0
        for fqn in order:
            for r, n in Counter(r for r, _, _ in by_fqn[fqn] if r != me).items():
                pending[r].append(n)
            if fqn in self._dtypes:
                boxes = {(i[2], i[3]) for r, k, i in by_fqn[fqn] if r != me or k not in self._straight}
                most = max(most, sum(aligned(nbytes(b[1], self._dtypes[fqn])) for b in boxes))
        slots = [torch.empty(most, dtype=torch.uint8), torch.empty(most, dtype=torch.uint8)]
        device = _device()
        sending: list[Any] = []
        reader = RegionReader(ckpt)

        def fetch(i: int) -> Any:
            if i >= len(order):
                return None
            return pool.submit(self._fetch, order[i], by_fqn[order[i]], slots[i % 2], reader, plan, planner, me)

        with ThreadPoolExecutor(1, thread_name_prefix="dcpstudio-read") as pool:
            ahead = fetch(0)
            try:
                for i in range(len(order)):
                    pieces = ahead.result()
                    _wait(sending)
                    ahead = fetch(i + 1)
                    sending = self._post(pieces, me, device, pending)
                    del pieces
                _wait(sending)
            except Exception as e:
                if ahead is not None:
                    ahead.cancel()
                self._fail(e, sending, pending, device)
                raise

    def _post(self, pieces: list[_Piece], me: int, device: torch.device, pending: dict[int, deque[int]]) -> list[Any]:
        """One header (status and each item's size) then each payload, to every other rank at once."""
        by_rank: dict[int, list[torch.Tensor]] = {}
        for r, _, payload in pieces:
            if r != me:
                by_rank.setdefault(r, []).append(payload)
        works: list[Any] = []
        for r, payloads in by_rank.items():
            pending[r].popleft()
            header = torch.tensor([_OK, *(p.numel() for p in payloads)], dtype=torch.int64, device=device)
            works.append((dist.isend(header, dst=r), header))
            for p in payloads:
                if p.numel():
                    p = p.to(device)
                    works.append((dist.isend(p, dst=r), p))
                    self.bytes_sent += p.numel()
        return works

    def _fail(self, e: Exception, sending: list[Any], pending: dict[int, deque[int]], device: torch.device) -> None:
        """Tell every rank that still waits for an entry why it will not come; each is then waiting
        for a header (the sends already posted are completed first), so the note lands there."""
        with contextlib.suppress(Exception):  # a broken connection: that rank failed too, and its launcher knows
            _wait(sending)
        note = f"{type(e).__name__}\n{e}".encode()[:4000]
        for r, left in pending.items():
            if left:
                header = torch.zeros(1 + left[0], dtype=torch.int64, device=device)
                header[0], header[1] = _FAILED, len(note)
                dist.send(header, dst=r)
                dist.send(torch.frombuffer(bytearray(note), dtype=torch.uint8).to(device), dst=r)

    # -- other ranks ------------------------------------------------------------------------------
    def _receive(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Entry by entry in the coordinator's order: a header, then every item received at once --
        straight into the target when its region is one contiguous run of the same dtype, else into
        a scratch buffer reused from entry to entry and copied over."""
        groups: dict[str, list[int]] = {fqn: [] for fqn in self._order}
        for k, item in enumerate(plan.items):
            groups.setdefault(item.storage_index.fqn, []).append(k)
        device = _device()
        scratch = torch.empty(0, dtype=torch.uint8, device=device)
        src = self.coordinator_rank
        for ks in groups.values():
            if not ks:
                continue
            header = torch.empty(1 + len(ks), dtype=torch.int64, device=device)
            dist.recv(header, src=src)
            status, *sizes = (int(x) for x in header.tolist())
            if status != _OK:
                note = torch.empty(sizes[0], dtype=torch.uint8, device=device)
                dist.recv(note, src=src)
                kind, _, message = bytes(note.cpu().tolist()).decode(errors="replace").partition("\n")
                raise _rebuild_error(kind, f"coordinator failed: {message}")
            direct = [_target_bytes(plan.items[k], planner, device.type, n) for k, n in zip(ks, sizes, strict=True)]
            need = sum(n for n, d in zip(sizes, direct, strict=True) if d is None)
            if need > scratch.numel():
                scratch = torch.empty(need, dtype=torch.uint8, device=device)
            works, copies, at = [], [], 0
            for k, n, d in zip(ks, sizes, direct, strict=True):
                if d is None:
                    buf = scratch[at : at + n]
                    copies.append((k, buf))
                    at += n
                else:
                    buf = d[1]
                if n:
                    works.append(dist.irecv(buf, src=src))
            _wait(works)
            self.bytes_received += sum(sizes)
            for k, buf in copies:
                self._apply(plan.items[k], buf.cpu(), planner)
            for k, d in zip(ks, direct, strict=True):
                if d is not None:
                    planner.commit_tensor(plan.items[k], d[0])

    @staticmethod
    def _apply(item: ReadItem, payload: torch.Tensor, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(tensor_buffer(payload.contiguous()))))
            return
        target = planner.resolve_tensor(item).detach()
        source = payload.view(_dtype_of(planner, item)).reshape(tuple(item.lengths))
        target.copy_(source)
        planner.commit_tensor(item, target)


def _target_bytes(
    item: ReadItem, planner: LoadPlanner, device: str, nbytes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An item's target region and a byte view of it, when its bytes can land there as they are
    stored: a tensor of the stored dtype, on ``device``, one contiguous run (of ``nbytes``)."""
    if item.type != LoadItemType.TENSOR:
        return None
    target = planner.resolve_tensor(item).detach()
    if (
        target.dtype != _dtype_of(planner, item)
        or target.device.type != device
        or not target.is_contiguous()
        or (nbytes is not None and target.numel() * target.element_size() != nbytes)
    ):
        return None
    return target, target.reshape(-1).view(torch.uint8)


def _wait(works: list[Any]) -> None:
    for w in works:
        (w[0] if isinstance(w, tuple) else w).wait()


def _dtype_of(planner: LoadPlanner, item: ReadItem) -> torch.dtype:
    md = getattr(planner, "metadata", None)
    tmd = md.state_dict_metadata[item.storage_index.fqn] if md is not None else None
    if not isinstance(tmd, TensorStorageMetadata):
        raise DCPStudioError(f"no tensor metadata for {item.storage_index.fqn}")
    return tmd.properties.dtype


TorchSaveReader = CheckpointReader  # the name of the first version, which read torch.save only
