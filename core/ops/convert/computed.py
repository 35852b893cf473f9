"""Cast tensors computed block by block straight into the blocks that are written.

A cast of elements that lie in place in a local file is the CPU-bound conversion. Done whole (read
the tensor into fresh memory, cast into fresh memory, write through the page cache), a 2 GiB
float32 -> bfloat16 conversion took ~5 s here, four fifths of it kernel time: page faults on the
fresh buffers and on the page cache's new pages (this VM hands freed memory back to its host within
~2 s, and gets it back one fault at a time). Here each block's source elements are read into one
recycled buffer and cast (:func:`~.casting.cast_into`) into a recycled aligned block that a
:class:`~...io.direct.DirectWriter` writes past the page cache; the next block is computed while
one is written. The single-process safetensors writer and a distributed conversion's ranks both
write casts this way, so their bytes are the same by construction.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

from ...errors import CorruptCheckpointError
from ...io.direct import Block, BlockPool, DirectWriter
from ...io.pipeline import prefetch
from ...io.raw import FileRange, pread_into
from ...pickles.refs import TensorRef
from .casting import cast_into, in_parts, torch_free
from .transform import _Cast

__all__ = ["BLOCK", "CastReader", "block_pool", "castable", "direct_writer", "write_cast"]

BLOCK = 16 << 20  # output bytes per block


def _source_range(t: TensorRef) -> tuple[_Cast, FileRange] | None:
    ref = t.storage
    if ref is None or not isinstance(ref.archive, _Cast) or not t.is_contiguous():
        return None
    cast = ref.archive
    src = cast.source
    if src.storage is None or src.storage.archive is None or not src.is_contiguous():
        return None
    where = src.storage.archive.storage_range(src.storage)
    if where is None or not isinstance(where.fd, int):
        return None
    return cast, FileRange(where.fd, where.offset + src.byte_offset, src.nbytes, None, where.base)


def castable(t: TensorRef) -> bool:
    """Whether ``t`` is a cast of elements lying in place in a local file (computed by blocks here)."""
    return _source_range(t) is not None


class CastReader:
    """Fills blocks of cast tensors from their source files; one read buffer, reused (one thread
    at a time fills)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def fill(self, t: TensorRef, start: int, end: int, out: memoryview) -> None:
        """Bytes ``[start, end)`` of ``t``'s row-major bytes (whole elements) into ``out``."""
        found = _source_range(t)
        assert found is not None, "not a cast of bytes in place"
        cast, where = found
        size, inner = t.dtype.itemsize, cast.source.dtype.itemsize
        s = (t.byte_offset + start) // size * inner
        n = (end - start) // size * inner
        if len(self._buf) < n:
            self._buf = bytearray(n)
        src = memoryview(self._buf)[:n]
        at = where.start() + s

        def part(a: int, b: int) -> None:  # elements [a, b): read, then cast, on the part's own thread
            if pread_into(where.fd, src[a * inner : b * inner], at + a * inner) < (b - a) * inner:
                raise CorruptCheckpointError(f"{cast.label}: a source file ends early (truncated?)")
            cast_into(src[a * inner : b * inner], cast.source.dtype, t.dtype, out[a * size : b * size], threads=1)

        if torch_free(cast.source.dtype, t.dtype):  # numpy's cast and the copy from the page cache, on threads
            in_parts(n // inner, part)
        else:  # torch's cast runs on its own threads
            part(0, n // inner)


def write_cast(
    writer: DirectWriter,
    reader: CastReader,
    t: TensorRef,
    at: int,
    check: Callable[[], None] = lambda: None,
    crc: bool = False,
) -> int:
    """Write all of cast ``t``'s bytes at offset ``at`` of ``writer``'s file, the next block
    computed while the current one is written; ``check()`` may raise to stop. Their CRC-32 with
    ``crc`` (a ZIP record's), else 0."""

    def make(span: tuple[int, int]) -> Block:
        check()
        s, e = span
        block = writer.block(at + s, e - s)
        reader.fill(t, s, e, block.view)
        return block

    unit = max(1, t.dtype.itemsize)
    step = BLOCK // unit * unit
    spans = [(s, min(t.nbytes, s + step)) for s in range(0, t.nbytes, step)]
    value = 0
    for _, block in prefetch(make, spans):
        if crc:
            value = zlib.crc32(block.view, value)
        writer.write(block)
    return value


def direct_writer(path: Path | str, fd: int, pool: BlockPool | None = None) -> DirectWriter:
    """A writer of blocks up to :data:`BLOCK` into ``path`` (open as ``fd``), from ``pool`` if given
    (one made with :func:`block_pool`)."""
    return DirectWriter(path, fd, BLOCK, pool=pool)


def block_pool() -> BlockPool:
    """Buffers for blocks of :data:`BLOCK` bytes, shared by the direct writers of many files."""
    return BlockPool(BLOCK)
