"""Content digests that do not depend on the format: the same tensor, the same digest, in a DCP
(any ranks, any chunks), a torch.save file (any view, stride or storage offset) and safetensors.

A tensor's digest is :mod:`...formats.digest`'s ``sha256-tree`` over its canonical bytes: a header
``tensor\\0DTYPE\\0SHAPE\\0`` (``float32``, ``4,3``) and the SHA-256 of each 16 MiB piece of its
elements in row-major order, little-endian, contiguous -- what ``t.contiguous()`` holds on a
little-endian machine, whatever the file kept. They are read block by block in row-major order
(:func:`~...io.blocks.blocks`), so a DCP tensor's bytes are assembled from its chunks in order, and
memory stays bounded; the pieces are hashed on two threads (hashlib releases the GIL) while the
next block is read. A non-tensor value's digest is over a canonical,
type-tagged encoding of it (:func:`value_digest`), tensors inside it by their canonical bytes.
"""

from __future__ import annotations

import contextlib
import math
import struct
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...checkpoints.base import Checkpoint
from ...checkpoints.canonical import CanonicalSource, RawBuffers, canonical_source
from ...checkpoints.model import dtype_name, refuse_expanded
from ...formats.digest import ALGORITHM, TreeHasher, canonical_header
from ...io.blocks import BLOCK_BUDGET, blocks, box_slices
from ...io.buffers import BufferPool
from ...pickles.tensor_io import to_bytes
from ...progress import CancelToken, ProgressCallback, Reporter

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHM", "Digest", "digests", "feed_tensor", "tensor_digest", "value_digest"]

_header = canonical_header  # one definition: manifests use it too
INLINE = 4 << 20  # smaller tensors are hashed on the reading thread: a hand-off costs more


@dataclass(frozen=True)
class Digest:
    """One entry's digest. ``dtype``/``shape`` are a tensor's (empty for a value)."""

    fqn: str
    kind: str  # "tensor" or "value"
    digest: str
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def line(self) -> str:
        shape = f"[{','.join(map(str, self.shape))}]" if self.kind == "tensor" else "-"
        return f"{self.digest}  {self.dtype or 'value'}  {shape}  {self.fqn}"

    def json(self) -> dict[str, Any]:
        return {"name": self.fqn, "kind": self.kind, "digest": self.digest, "dtype": self.dtype or None,
                "shape": list(self.shape) if self.kind == "tensor" else None}  # fmt: skip


def _little(t: torch.Tensor) -> memoryview:
    """A tensor's row-major bytes, little-endian."""
    data = to_bytes(t)
    if struct.pack("=H", 1) == b"\x01\x00" or t.element_size() == 1:
        return data
    import numpy as np

    swapped = np.frombuffer(data, dtype=f">u{t.element_size()}").astype(f"<u{t.element_size()}")
    return swapped.data.cast("B")


def tensor_digest(
    ckpt: Checkpoint,
    fqn: str,
    *,
    budget: int = BLOCK_BUDGET,
    reporter: Reporter | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> Digest:
    """The digest of tensor ``fqn``, read by :func:`feed_tensor`; its 16 MiB pieces are hashed on
    ``pool``'s threads (two of its own if none is given) while the next block is read."""
    entry = ckpt.tensor_entry(fqn)
    refuse_expanded(entry, str(ckpt.path), "hash")
    assert entry.dtype is not None
    dtype, shape = dtype_name(entry.dtype) or "", tuple(entry.shape or ())
    nbytes = math.prod(shape) * entry.dtype.itemsize
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcpstudio-hash"))
        h = TreeHasher(_header(dtype, shape), pool if nbytes > INLINE else None, nbytes)
        feed_tensor(ckpt, fqn, h.update, budget=budget, reporter=reporter)
        return Digest(fqn, "tensor", h.digest(), dtype, shape)


_RAW_BUFFERS = RawBuffers(keep=6)  # one set for every tensor of a run: no fresh pages per tensor


def feed_tensor(
    ckpt: Checkpoint,
    fqn: str,
    update: Callable[[memoryview], list[Future[bytes]]],
    *,
    budget: int = BLOCK_BUDGET,
    reporter: Reporter | None = None,
) -> None:
    """Feed ``update`` (a :class:`TreeHasher`'s or a manifest tap's) tensor ``fqn``'s canonical
    bytes in row-major blocks of at most ``budget`` bytes: read in place without torch where they
    lie so (:func:`canonical_source`: recycled buffers), else through torch. A block's buffer is
    given back only once the futures ``update`` returned for it are done; the block read next
    overlaps the hashing of the two before."""
    reporter = reporter or Reporter(None, None)
    source = canonical_source(ckpt, fqn) if sys.byteorder == "little" else None
    fed = _in_place(source, budget) if source is not None else _through_torch(ckpt, fqn, budget, reporter)
    inflight: deque[tuple[list[Future[bytes]], Any, Callable[[Any], None]]] = deque()
    try:
        for data, owner, give in fed:
            reporter.check()
            reporter.advance(data.nbytes, items=0, current=fqn)
            futures = update(data)
            del data
            if not futures:
                give(owner)  # hashed (or gathered) already
                continue
            inflight.append((futures, owner, give))
            while len(inflight) > 2:
                done, owner, give = inflight.popleft()
                for fut in done:
                    fut.result()
                give(owner)
        while inflight:
            done, owner, give = inflight.popleft()
            for fut in done:
                fut.result()
            give(owner)
    finally:
        for done, _, _ in inflight:
            for fut in done:
                fut.cancel()


def _in_place(source: CanonicalSource, budget: int) -> Iterator[tuple[memoryview, Any, Callable[[Any], None]]]:
    for block in source.blocks(budget, _RAW_BUFFERS):
        yield memoryview(block), block, _RAW_BUFFERS.give


def _through_torch(
    ckpt: Checkpoint, fqn: str, budget: int, reporter: Reporter
) -> Iterator[tuple[memoryview, Any, Callable[[Any], None]]]:
    entry = ckpt.tensor_entry(fqn)
    assert entry.dtype is not None
    buffers = BufferPool(keep=4)
    for offsets, sizes in blocks(tuple(entry.shape or ()), entry.dtype.itemsize, budget):
        reporter.check()
        with buffers.active():
            block = ckpt.read_tensor(fqn, box_slices(offsets, sizes))
        yield _little(block), block, buffers.give


def _encode(value: Any, h: Any, depth: int = 0) -> None:
    """Feeds ``h`` a type-tagged, length-prefixed encoding of ``value``: equal values of the same
    types give equal bytes (dict keys sorted by their own encoding, floats by their bits). Torch
    is looked at only when loaded: a value read without it holds no torch tensor."""
    torch = sys.modules.get("torch")

    if depth > 64:
        raise ValueError("a value nested more than 64 deep")
    if value is None or isinstance(value, bool):
        h.update(f"{value!r}\0".encode())
    elif isinstance(value, int):
        h.update(b"i" + str(value).encode() + b"\0")
    elif isinstance(value, float):
        h.update(b"f" + (b"nan" if math.isnan(value) else struct.pack("<d", value)))
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        h.update(b"s%d\0" % len(raw) + raw)
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"b%d\0" % len(value) + bytes(value))
    elif torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        h.update(b"T" + _header(dtype_name(t.dtype) or "", list(t.shape)))
        h.update(_little(t))
    elif isinstance(value, (list, tuple)):
        h.update(b"%s%d\0" % (b"l" if isinstance(value, list) else b"t", len(value)))
        for item in value:
            _encode(item, h, depth + 1)
    elif isinstance(value, dict):
        items = []
        for k, v in value.items():
            kh = TreeHasher(b"key\0")
            _encode(k, kh, depth + 1)
            items.append((kh.digest().encode(), v))
        h.update(b"d%d\0" % len(items))
        for key, v in sorted(items, key=lambda kv: kv[0]):
            h.update(key)
            _encode(v, h, depth + 1)
    else:
        kind = type(value)
        h.update(f"o{kind.__module__}.{kind.__qualname__}\0{value!r}\0".encode("utf-8", "surrogatepass"))


def value_digest(value: Any) -> str:
    """The digest of a non-tensor value (its tensors materialised) over :func:`_encode`'s bytes."""
    h = TreeHasher(b"value\0")
    _encode(value, h)
    return h.digest()


def digests(
    ckpt: Checkpoint,
    *,
    budget: int = BLOCK_BUDGET,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> list[Digest]:
    """Every entry's digest, in the checkpoint's order."""
    reporter = Reporter(progress, cancel, total_bytes=ckpt.tensor_bytes, total_items=len(ckpt.entries))
    out = []
    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcpstudio-hash") as pool:
            for fqn, entry in ckpt.entries.items():
                reporter.check()
                if entry.kind == "tensor":
                    out.append(tensor_digest(ckpt, fqn, budget=budget, reporter=reporter, pool=pool))
                else:
                    out.append(Digest(fqn, "value", value_digest(ckpt.read_value(fqn))))
                reporter.advance(0, current=fqn)
    finally:
        _RAW_BUFFERS.clear()
    return out
