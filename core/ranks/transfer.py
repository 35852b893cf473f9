"""The coordinator-to-rank byte protocol of :class:`~dcpstudio.core.ranks.distributed.CheckpointReader`.

Entry by entry, in the metadata's order, the coordinator sends each rank that wants something of
the entry one header -- a status and the size of each of the rank's items -- then each item's
bytes; all ranks' messages are posted at once (``isend``). A rank receives the header, then every
item at once, straight into its target when the target region is one contiguous run of the
stored dtype. On failure the coordinator sends every rank that still waits a header with the
failed status and the error's text, which that rank raises; a rank that fails itself keeps
receiving (and dropping) what was posted for it, so the coordinator is never left sending.
"""

from __future__ import annotations

import contextlib
import io
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .. import errors
from ..errors import DCPStudioError
from ..io.raw import tensor_buffer

__all__ = ["Piece", "apply", "device", "fail", "post", "rebuild_error", "receive", "target_bytes", "wait"]

_OK, _FAILED = 0, 1

Piece = tuple[int, int, torch.Tensor]  # (rank, index in that rank's plan, the item's bytes)


def device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def rebuild_error(kind: str, message: str) -> Exception:
    cls = getattr(errors, kind, None)
    return cls(message) if isinstance(cls, type) and issubclass(cls, Exception) else DCPStudioError(message)


def dtype_of(md: Metadata, item: ReadItem) -> torch.dtype:
    """The dtype the checkpoint stores an item in: from the storage reader's metadata, never the
    planner's, which may describe the targets instead (``DynamicMetaLoadPlanner``)."""
    tmd = md.state_dict_metadata.get(item.storage_index.fqn)
    if not isinstance(tmd, TensorStorageMetadata):
        raise DCPStudioError(f"no tensor metadata for {item.storage_index.fqn}")
    return tmd.properties.dtype


def target_bytes(
    item: ReadItem, planner: LoadPlanner, md: Metadata, on: str, nbytes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An item's target region and a byte view of it, when its bytes can land there as they are
    stored: a tensor of the stored dtype, on device type ``on``, one contiguous run (of ``nbytes``)."""
    if item.type != LoadItemType.TENSOR:
        return None
    target = planner.resolve_tensor(item).detach()
    if (
        target.dtype != dtype_of(md, item)
        or target.device.type != on
        or not target.is_contiguous()
        or (nbytes is not None and target.numel() * target.element_size() != nbytes)
    ):
        return None
    return target, target.reshape(-1).view(torch.uint8)


def apply(item: ReadItem, payload: torch.Tensor, planner: LoadPlanner, md: Metadata) -> None:
    """Hand an item's bytes to the planner: unpickled for a value, copied (and cast) for a tensor."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(bytes(tensor_buffer(payload.contiguous()))))
        return
    target = planner.resolve_tensor(item).detach()
    target.copy_(payload.view(dtype_of(md, item)).reshape(tuple(item.lengths)))
    planner.commit_tensor(item, target)


def wait(works: list[Any]) -> None:
    for w in works:
        (w[0] if isinstance(w, tuple) else w).wait()


def post(pieces: list[Piece], me: int, on: torch.device, pending: dict[int, deque[int]]) -> tuple[list[Any], int]:
    """Send one entry's pieces to every other rank at once; the works (with the tensors they send,
    kept alive until waited for) and the bytes sent. ``pending[r]`` loses the entry's count."""
    by_rank: dict[int, list[torch.Tensor]] = {}
    for r, _, payload in pieces:
        if r != me:
            by_rank.setdefault(r, []).append(payload)
    works: list[Any] = []
    sent = 0
    for r, payloads in by_rank.items():
        pending[r].popleft()
        header = torch.tensor([_OK, *(p.numel() for p in payloads)], dtype=torch.int64, device=on)
        works.append((dist.isend(header, dst=r), header))
        for p in payloads:
            if p.numel():
                p = p.to(on)
                works.append((dist.isend(p, dst=r), p))
                sent += p.numel()
    return works, sent


def fail(e: Exception, sending: list[Any], pending: dict[int, deque[int]], on: torch.device) -> None:
    """Tell every rank that still waits for an entry why it will not come; each is then waiting
    for a header (the sends already posted are completed first), so the note lands there."""
    with contextlib.suppress(Exception):  # a broken connection: that rank failed too, and its launcher knows
        wait(sending)
    note = f"{type(e).__name__}\n{e}".encode()[:4000]
    for r, left in pending.items():
        if left:
            header = torch.zeros(1 + left[0], dtype=torch.int64, device=on)
            header[0], header[1] = _FAILED, len(note)
            dist.send(header, dst=r)
            dist.send(torch.frombuffer(bytearray(note), dtype=torch.uint8).to(on), dst=r)


def receive(plan: LoadPlan, planner: LoadPlanner, md: Metadata, order: list[str], src: int) -> int:
    """A rank's side, entry by entry in ``order``; items that cannot land in their targets as they
    are go through one scratch buffer, reused from entry to entry. Returns the bytes received.

    A failure here (a target that rejects its bytes, memory) does not stop the receiving: the
    coordinator has posted this rank's sends and waits for them, so every later entry is still
    received -- into a discarded buffer -- and the first error is raised at the end."""
    groups: dict[str, list[int]] = {fqn: [] for fqn in order}
    for k, item in enumerate(plan.items):
        groups.setdefault(item.storage_index.fqn, []).append(k)
    on = device()
    scratch = torch.empty(0, dtype=torch.uint8, device=on)
    received = 0
    error: Exception | None = None
    for ks in groups.values():
        if not ks:
            continue
        header = torch.empty(1 + len(ks), dtype=torch.int64, device=on)
        dist.recv(header, src=src)
        status, *sizes = (int(x) for x in header.tolist())
        if status != _OK:
            note = torch.empty(sizes[0], dtype=torch.uint8, device=on)
            dist.recv(note, src=src)
            kind, _, message = bytes(note.cpu().tolist()).decode(errors="replace").partition("\n")
            raise rebuild_error(kind, f"coordinator failed: {message}")
        received += sum(sizes)
        if error is None:
            try:
                direct = [target_bytes(plan.items[k], planner, md, on.type, n) for k, n in zip(ks, sizes, strict=True)]
                need = sum(n for n, d in zip(sizes, direct, strict=True) if d is None)
                if need > scratch.numel():
                    scratch = torch.empty(need, dtype=torch.uint8, device=on)
            except Exception as e:
                error = e
        if error is not None:  # this entry's bytes are on their way all the same: take and drop them
            _discard(sizes, src, on)
            continue
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
        wait(works)
        try:
            for k, buf in copies:
                apply(plan.items[k], buf.cpu(), planner, md)
            for k, d in zip(ks, direct, strict=True):
                if d is not None:
                    planner.commit_tensor(plan.items[k], d[0])
        except Exception as e:
            error = e
    if error is not None:
        raise error
    return received


def _discard(sizes: list[int], src: int, on: torch.device) -> None:
    """Receive items of ``sizes`` bytes one after another into one buffer, and drop them."""
    most = max(sizes, default=0)
    if most:
        sink = torch.empty(most, dtype=torch.uint8, device=on)  # a message is received whole
        for n in sizes:
            if n:
                dist.recv(sink[:n], src=src)
