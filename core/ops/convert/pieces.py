"""Writing a rank's pieces of a laid-out output (:mod:`.layout`): positioned writes into its
pre-sized files. A piece's bytes that lie in place are read into aligned buffers written past the
page cache (or, where the file refuses ``O_DIRECT`` and no CRC is needed, copied in the kernel);
a cast is computed by blocks into such buffers (:mod:`.computed`); the rest is computed whole
once and sliced (a view that is not contiguous, a mapping's output, chunks to assemble)."""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...errors import CorruptCheckpointError
from ...io.direct import Block, DirectWriter, pwrite_all
from ...io.pipeline import prefetch
from ...io.raw import FileRange, pread_into
from ...pickles.refs import TensorRef
from ...pickles.tensor_io import materialize, to_bytes
from .computed import CastReader, block_pool, castable, direct_writer
from .layout import GRAIN, Layout, Piece
from .transform import _Cast

__all__ = ["write_pieces"]


class _Source:
    """A tensor's row-major bytes by range: in place in a file (a :class:`FileRange`), a cast of
    exactly the source elements the range needs, or -- for what is computed whole (a view that
    is not contiguous, a mapping's output, chunks to assemble) -- computed once and sliced."""

    def __init__(self) -> None:
        self._whole: tuple[int, Any, memoryview] | None = None  # (id, its owner kept alive, its bytes)

    def bytes(self, t: TensorRef, start: int, end: int) -> FileRange | memoryview:
        ref = t.storage
        if ref is None or ref.archive is None:
            raise CorruptCheckpointError("a tensor saved without data (meta device) has no values")
        if t.is_contiguous():
            s, e = t.byte_offset + start, t.byte_offset + end
            where = ref.archive.storage_range(ref)
            if where is not None:
                return FileRange(where.fd, where.offset + s, e - s, None, where.base)
            archive = ref.archive
            if isinstance(archive, _Cast):
                return self._cast(archive, t, s, e)
            return self._computed(ref, lambda: archive.storage_bytes(ref))[s:e]
        return self._computed(t, lambda: to_bytes(materialize(t)))[start:end]

    def _cast(self, cast: _Cast, t: TensorRef, s: int, e: int) -> memoryview:
        import torch

        src, out = cast.source, t.dtype.itemsize
        inner = src.dtype.itemsize
        data = self.bytes(src, s // out * inner, e // out * inner)
        if isinstance(data, FileRange):
            data = _read(data)
        if not data.nbytes:
            return memoryview(b"")
        values = torch.frombuffer(data, dtype=src.dtype.torch)
        return to_bytes(values.to(cast.to.torch))

    def _computed(self, key: Any, compute: Callable[[], memoryview]) -> memoryview:
        if self._whole is None or self._whole[0] != id(key):
            self._whole = None
            self._whole = (id(key), key, memoryview(compute()).cast("B"))
        return self._whole[2]


def _read(r: FileRange) -> memoryview:
    buf = bytearray(r.nbytes)
    view = memoryview(buf)
    if pread_into(r.fd, view, r.start()) < r.nbytes:
        raise CorruptCheckpointError("a source file ends early (truncated?)")
    return view


def _kernel_copy(r: FileRange, fd: int, offset: int) -> bool:
    """Copy ``r`` to ``offset`` of ``fd`` inside the kernel; False where that is not possible."""
    if not isinstance(r.fd, int) or not hasattr(os, "copy_file_range"):
        return False
    src, left = r.start(), r.nbytes
    while left:
        try:
            n = os.copy_file_range(r.fd, fd, left, src, offset)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF) and src == r.start():
                return False
            raise
        if n == 0:
            raise CorruptCheckpointError("a source file ends early (truncated?)")
        src, offset, left = src + n, offset + n, left - n
    return True


def write_pieces(
    layout: Layout,
    pieces: Sequence[Piece],
    root: Path,
    advance: Callable[[int], None],
    check: Callable[[], None] = lambda: None,
) -> list[tuple[int, int, int]]:
    """Write ``pieces`` into the pre-sized files under ``root`` (positioned writes), each file
    flushed to stable storage; returns ``(hole, start, crc)`` per piece (crc 0 when the layout
    needs none). ``advance(n)`` after each block; ``check()`` may raise to stop.

    Casts are computed into aligned blocks written past the page cache, and so are bytes that lie
    in place, read into such a block, when the file takes ``O_DIRECT``; where it does not, bytes in
    place that need no CRC are copied in the kernel. All files' blocks come from one pool."""
    source = _Source()
    casts = CastReader()
    fds: dict[str, int] = {}
    direct: dict[str, DirectWriter] = {}
    out: list[tuple[int, int, int]] = []
    pool = block_pool()
    try:
        for p in pieces:  # opened here: the blocks are made on another thread
            name = layout.holes[p.hole][0]
            if name not in fds:
                path = root / name if name else root
                fds[name] = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                direct[name] = direct_writer(path, fds[name], pool)
        return _write(layout, pieces, fds, direct, source, casts, advance, check, out)
    finally:
        for w in direct.values():
            w.close()
        pool.close()
        for fd in fds.values():
            os.close(fd)


def _write(
    layout: Layout,
    pieces: Sequence[Piece],
    fds: dict[str, int],
    direct: dict[str, DirectWriter],
    source: _Source,
    casts: CastReader,
    advance: Callable[[int], None],
    check: Callable[[], None],
    out: list[tuple[int, int, int]],
) -> list[tuple[int, int, int]]:
    def blocks() -> Iterator[tuple[Piece, int, int]]:
        for p in pieces:
            for s in range(p.start, p.end, GRAIN):
                yield p, s, min(p.end, s + GRAIN)

    def produce(block: tuple[Piece, int, int]) -> FileRange | memoryview | Block:
        check()
        p, s, e = block
        t = layout.sources[p.hole]
        name, offset = layout.holes[p.hole][0], layout.holes[p.hole][1]
        writer = direct[name]
        if castable(t):  # computed into the block that is written
            made = writer.block(offset + s, e - s)
            casts.fill(t, s, e, made.view)
            return made
        data = source.bytes(t, s, e)
        if isinstance(data, FileRange) and (writer.direct or layout.crc or not isinstance(data.fd, int)):
            made = writer.block(offset + s, e - s)
            if pread_into(data.fd, made.view, data.start()) < data.nbytes:
                raise CorruptCheckpointError("a source file ends early (truncated?)")
            return made
        return data

    crc = 0
    for (p, s, e), data in prefetch(produce, blocks()):
        name, offset = layout.holes[p.hole][0], layout.holes[p.hole][1]
        fd = fds[name]
        if isinstance(data, FileRange) and not _kernel_copy(data, fd, offset + s):
            data = _read(data)
        if isinstance(data, Block):
            if data.nbytes != e - s:
                raise CorruptCheckpointError(f"tensor {p.hole}: {data.nbytes} bytes computed, {e - s} expected")
            if layout.crc:
                crc = zlib.crc32(data.view, crc if s > p.start else 0)
            direct[name].write(data)
        elif not isinstance(data, FileRange):
            if data.nbytes != e - s:
                raise CorruptCheckpointError(f"tensor {p.hole}: {data.nbytes} bytes computed, {e - s} expected")
            if layout.crc:
                crc = zlib.crc32(data, crc if s > p.start else 0)
            pwrite_all(fd, data, offset + s)
        if e == p.end:
            out.append((p.hole, p.start, crc if layout.crc else 0))
            crc = 0
        advance(e - s)
    for fd in fds.values():
        os.fsync(fd)
    return out
