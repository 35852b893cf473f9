"""A tensor's canonical bytes -- row-major, contiguous, native (little-endian) order -- read
straight from its files block by block, without torch.

``hash``, ``check --values`` and a bitwise ``verify`` need a tensor's bytes, not a torch tensor:
importing torch alone costs ~1.8 s and ~220 MiB. :func:`canonical_source` says how to read them
when they lie in place: a DCP tensor's chunks whose archives store their elements uncompressed in
native order (assembled box by box with numpy), a torch.save tensor whose storage lies in place
(any view, stride or offset, through numpy's ``as_strided`` over a bounded window of its storage),
safetensors byte ranges (one file or shards). Anything else -- a compressed or byte-swapped chunk,
an expanded view, a window too large -- gets None, and the caller takes the torch path
(``read_tensor``), which reads the same bytes.

Blocks are :func:`~..io.blocks.blocks`' row-major boxes, each read with large ``preadv`` calls into
a buffer of a :class:`RawBuffers` pool, handed back by the consumer once it is done with it, so a
long read faults no fresh pages in per block.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from typing import IO, Any

from ..errors import CorruptCheckpointError
from ..io.blocks import blocks
from ..io.raw import contiguous_span, read_exact
from .base import Checkpoint, _overlaps
from .dcp.checkpoint import DCPCheckpoint
from .safetensors import SafetensorsCheckpoint
from .torchsave import TorchCheckpoint

__all__ = ["CanonicalSource", "RawBuffers", "canonical_source", "chunked_source"]

_WINDOW = 256 << 20  # the most storage bytes a strided torch.save view is read through at once


class RawBuffers:
    """Recycled uint8 numpy buffers by byte size (at most ``keep`` free); thread-safe."""

    def __init__(self, keep: int = 6) -> None:
        self._keep = keep
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Any:
        import numpy as np

        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes == nbytes:
                    return self._free.pop(i)
        return np.empty(nbytes, np.uint8)

    def give(self, buf: Any) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)

    def clear(self) -> None:
        """Let the free buffers go (a long-lived process keeps no block memory between runs)."""
        with self._lock:
            self._free.clear()


class _Piece:
    """Where a box of the tensor lies in place: ``f`` at ``offset``, a row-major array of ``sizes``."""

    __slots__ = ("f", "label", "offset", "offsets", "sizes")

    def __init__(self, f: IO[bytes], offset: int, offsets: Sequence[int], sizes: Sequence[int], label: str) -> None:
        self.f, self.offset, self.offsets, self.sizes, self.label = f, offset, tuple(offsets), tuple(sizes), label


class CanonicalSource:
    """How to read one tensor's canonical bytes without torch (see the module's docstring)."""

    def __init__(
        self, shape: Sequence[int], itemsize: int, pieces: list[_Piece] | None = None, view: Any = None
    ) -> None:
        self.shape = tuple(shape)
        self.itemsize = itemsize
        self.nbytes = math.prod(self.shape) * itemsize
        self._pieces = pieces or []
        self._view = view  # (f, offset, span, storage_offset, strides, label) of a strided view

    def blocks(self, budget: int, buffers: RawBuffers) -> Iterator[Any]:
        """Row-major blocks of at most ``budget`` bytes, as uint8 arrays taken from ``buffers``
        (the consumer gives each back when done with it)."""
        if self._view is not None:
            yield from self._strided(budget, buffers)
            return
        for offsets, sizes in blocks(self.shape, self.itemsize, budget):
            yield self.read(offsets, sizes, buffers)

    @property
    def boxed(self) -> bool:
        """Whether :meth:`read` takes any box: the bytes lie in row-major pieces, not a strided view."""
        return self._view is None

    def read(self, offsets: list[int], sizes: list[int], buffers: RawBuffers) -> Any:
        """One row-major box of :func:`~..io.blocks.blocks` as a uint8 array from ``buffers`` (the
        consumer gives it back); only when :attr:`boxed`."""
        if self._view is not None:
            raise ValueError("a strided view is read whole: use blocks()")
        out = buffers.take(math.prod(sizes) * self.itemsize)
        try:
            self._fill(out, offsets, sizes, buffers)
        except BaseException:
            buffers.give(out)
            raise
        return out

    def _fill(self, out: Any, offsets: list[int], sizes: list[int], buffers: RawBuffers) -> None:
        tiles = [(p.offsets, p.sizes) for p in self._pieces]
        for k, local, size, at in _overlaps(offsets, sizes, tiles):
            p = self._pieces[k]
            src = contiguous_span(p.sizes, local, size)
            if src is None:  # blocks are runs of the tensor, so their part of a piece is one run of it
                raise CorruptCheckpointError(f"{p.label}: a block is not one run of a chunk")
            n = src[1] * self.itemsize
            dst = contiguous_span(sizes, at, size)
            if dst is not None:
                start = dst[0] * self.itemsize
                read_exact(p.f, p.offset + src[0] * self.itemsize, memoryview(out[start : start + n]), p.label)
                continue
            scratch = buffers.take(n)
            try:
                read_exact(p.f, p.offset + src[0] * self.itemsize, memoryview(scratch), p.label)
                grid = out.reshape(*sizes[:-1], sizes[-1] * self.itemsize)
                region = tuple(slice(a, a + m) for a, m in zip(at[:-1], size[:-1], strict=True))
                region += (slice(at[-1] * self.itemsize, (at[-1] + size[-1]) * self.itemsize),)
                grid[region] = scratch.reshape(*size[:-1], size[-1] * self.itemsize)
            finally:
                buffers.give(scratch)

    def _strided(self, budget: int, buffers: RawBuffers) -> Iterator[Any]:
        import numpy as np

        f, offset, span, storage_offset, strides, label = self._view
        window = buffers.take(span * self.itemsize)
        try:
            read_exact(f, offset, memoryview(window), label)
            elem = np.dtype(f"V{self.itemsize}")
            base = window.view(elem)
            view = np.lib.stride_tricks.as_strided(
                base[storage_offset:], self.shape, [s * self.itemsize for s in strides], writeable=False
            )
            for offsets, sizes in blocks(self.shape, self.itemsize, budget):
                out = buffers.take(math.prod(sizes) * self.itemsize)
                box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
                out.view(elem).reshape(sizes)[...] = view[box]
                yield out
        finally:
            buffers.give(window)


def chunked_source(
    shape: Sequence[int], itemsize: int, chunks: Sequence[tuple[Any, int, Sequence[int], Sequence[int], str]]
) -> CanonicalSource:
    """A tensor's canonical bytes from row-major chunks ``(file, data offset, offsets, sizes,
    label)`` that tile it (or the part of it that will be read): an output being written, read
    back before it is a checkpoint (:mod:`~..ops.convert.reshard_manifest`)."""
    return CanonicalSource(shape, itemsize, [_Piece(f, at, o, s, label) for f, at, o, s, label in chunks])


def canonical_source(ckpt: Checkpoint, fqn: str) -> CanonicalSource | None:
    """How to read tensor ``fqn``'s canonical bytes without torch, or None (use ``read_tensor``).
    Raises what the readers raise for damage (a chunk table that does not tile, a short file)."""
    entry = ckpt.tensor_entry(fqn)
    dt = entry.dtype
    if dt is None or dt.kind == "q":
        return None
    shape = tuple(entry.shape or ())
    if isinstance(ckpt, DCPCheckpoint):
        if fqn in getattr(ckpt, "_nested", ()):  # inside an unflattened byte item: read through its archive
            return None
        pieces = []
        for c in ckpt.chunks(fqn):  # checked to tile the tensor
            raw = ckpt._raw_offset(fqn, c)
            if raw is None:
                return None
            label = f"{ckpt.path / (c.file or '')} ({fqn!r})"
            pieces.append(_Piece(ckpt._files.get(c.file or ""), raw, c.offsets, c.sizes, label))
        return CanonicalSource(shape, dt.itemsize, pieces)
    if isinstance(ckpt, SafetensorsCheckpoint):
        parts = ckpt._local(fqn)
        pieces = [_Piece(ckpt._file(t.file), t.data_offset, t.offsets, t.shape, str(t.file)) for t in parts]
        return CanonicalSource(shape, dt.itemsize, pieces)
    if isinstance(ckpt, TorchCheckpoint):
        return _torch_source(ckpt, fqn, shape, dt.itemsize)
    return None


def _torch_source(ckpt: TorchCheckpoint, fqn: str, shape: tuple[int, ...], itemsize: int) -> CanonicalSource | None:
    ref = ckpt.tensor_ref(fqn)
    file = ckpt._file_of[fqn]
    if ref.storage is None or ref.dtype.itemsize != itemsize or tuple(ref.shape) != shape:
        return None
    if not ref.numel:
        return CanonicalSource(shape, itemsize, [])
    where = file.storage_file(ref.storage)
    if where is None:
        return None
    f, start = where
    if ref.is_contiguous():
        return CanonicalSource(
            shape, itemsize, [_Piece(f, start + ref.byte_offset, (0,) * len(shape), shape, file.label)]
        )
    strides = tuple(ref.stride)
    if any(s <= 0 for s, n in zip(strides, shape, strict=True) if n > 1):
        return None  # an expanded view: refused by the caller as the torch path refuses it
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if span * itemsize > _WINDOW:
        return None
    first = ref.storage_offset
    view = (f, start + first * itemsize, span, 0, strides, file.label)
    return CanonicalSource(shape, itemsize, view=view)
