"""The manifest of a resharded DCP (:mod:`.reshard`), computed from the output's own bytes as the
DCP writer computes its own (:class:`~...formats.readback.ReadBack`): each file's SHA-256 on one
thread as it grows, each tensor's 16 MiB pieces (SHA-256 and moments) on two, read back from the
page cache while the next chunks are written.

A tensor's digest and moments are of its canonical row-major bytes (the same in any layout), but a
resharded tensor lies in chunks spread over the ranks' files, written file after file: a piece is
read back once every chunk holding part of its rows is written, assembled box by box
(:func:`~...io.blocks.run_blocks`, 1 MiB boxes) from those chunks
(:func:`~...checkpoints.canonical.chunked_source`). Under ``shard0`` on a 1-D mesh a piece is
ready when its rank's file reaches it; where every rank holds part of every row (``shard1``) only
once the last file reaches the tensor, so the read-back trails the writer by all the other files --
memory stays a few boxes either way; the read-back's 1 GiB lag bound waits only for what is ready.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from ...checkpoints.canonical import CanonicalSource, RawBuffers, chunked_source
from ...dtypes import DType
from ...formats.dcp.ranked import StoredItem
from ...formats.digest import PIECE, Moments
from ...formats.manifest import Manifest
from ...formats.readback import ReadBack
from ...io.blocks import run_blocks

__all__ = ["RankedReadBack"]

_BOX = 1 << 20  # bytes of one box read back (the DCP writer's read-back reads 1 MiB at a time)
_OPEN = 64  # data files a read-back thread keeps open


class _Files:
    """The data files as the read-back threads read them: each thread keeps the last
    :data:`_OPEN` it read open. A piece under ``shard1`` has part of every rank's file, and one
    descriptor per file would pass the usual limit of 1,024 for a layout for thousands of ranks."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[int] = set()

    def fd(self, path: Path) -> int:
        cache: OrderedDict[Path, int] | None = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = OrderedDict()
        fd = cache.get(path)
        if fd is not None:
            cache.move_to_end(path)
            return fd
        if len(cache) >= _OPEN:  # this thread's own: no other thread reads through it
            _, old = cache.popitem(last=False)
            with self._lock:
                self._open.discard(old)
            os.close(old)
        fd = os.open(path, os.O_RDONLY)
        with self._lock:
            self._open.add(fd)
        cache[path] = fd
        return fd

    def close(self) -> None:
        """Once the threads have ended."""
        with self._lock:
            for fd in self._open:
                os.close(fd)
            self._open.clear()


class _DataFile:
    """A data file as :func:`~...io.raw.read_exact` preads from it, opened by the reading thread."""

    def __init__(self, files: _Files, path: Path) -> None:
        self._files, self.path = files, path

    def fileno(self) -> int:
        return self._files.fd(self.path)


class _Tensor:
    def __init__(self, fqn: str, dtype: DType, shape: tuple[int, ...], slots: list[Any]) -> None:
        self.fqn, self.dtype, self.shape, self.slots = fqn, dtype, shape, slots
        self.chunks: list[tuple[_DataFile, int, tuple[int, ...], tuple[int, ...], str]] = []  # each written so far


class RankedReadBack:
    """A :class:`~...formats.dcp.ranked.Watch` that reads a resharded DCP back for its manifest.

    ``files``: each data file's items in the order they are written (files in order);
    ``tensors``: each tensor's dtype and shape as written; ``check`` raises to cancel (called while
    the last pieces are read back, which under ``shard1`` is all of them). Use it as a context
    manager around the write: its threads and descriptors end with it, failed or not."""

    def __init__(
        self,
        files: Sequence[Sequence[StoredItem]],
        tensors: Mapping[str, tuple[DType, tuple[int, ...]]],
        check: Callable[[], None] = lambda: None,
    ) -> None:
        self.back = ReadBack()
        self._check = check
        self._manifest = Manifest()
        self._buffers = RawBuffers(keep=8)
        self._files = _Files()
        self._paths: dict[str, _DataFile] = {}
        self._file: Any = None
        self._done = 0  # items written
        self._tensors: dict[str, _Tensor] = {}
        for fqn, (dtype, shape) in tensors.items():
            nbytes = math.prod(shape) * dtype.itemsize
            slots = self.back.expect(self._manifest.tensors, fqn, dtype.name, shape, -(-nbytes // PIECE))
            self._tensors[fqn] = _Tensor(fqn, dtype, shape, slots)
        # each piece becomes readable once the last item written among its rows' chunks is in
        rows: dict[str, list[tuple[int, int, int]]] = {fqn: [] for fqn in tensors}  # (first row, end row, seq)
        seq = 0
        for items in files:
            for item in items:
                seq += 1
                if item.offsets is not None and all(item.sizes):
                    lo = item.offsets[0] if item.offsets else 0
                    hi = lo + item.sizes[0] if item.sizes else 1
                    rows[item.fqn].append((lo, hi, seq))
        self._ready: list[tuple[int, str, int]] = []  # (seq it waits for, tensor, piece), sorted
        for t in self._tensors.values():
            inner = math.prod(t.shape[1:]) * t.dtype.itemsize
            for k in range(len(t.slots)):
                first = k * PIECE // inner if t.shape else 0
                end = (min((k + 1) * PIECE, math.prod(t.shape) * t.dtype.itemsize) - 1) // inner + 1 if t.shape else 1
                wait = max(s for lo, hi, s in rows[t.fqn] if lo < end and first < hi)
                self._ready.append((wait, t.fqn, k))
        self._ready.sort()
        self._waits = [w for w, _, _ in self._ready]
        self._next = 0

    def __enter__(self) -> RankedReadBack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.back.close()
        self._files.close()
        self._buffers.clear()

    def file(self, path: Path) -> None:
        if self._file is not None:
            self.back.done(self._file)
        self._file = self.back.file(path)
        self._paths[path.name] = _DataFile(self._files, path)

    def written(self, item: StoredItem, file_name: str, data_at: int, f: Any) -> None:
        self.back.advance(self._file, f)  # flushed: what follows reads the bytes from the file
        self._done += 1
        t = self._tensors.get(item.fqn) if item.offsets is not None else None
        if t is not None:
            label = f"{self._file.path} ({item.fqn!r})"
            t.chunks.append((self._paths[file_name], data_at, item.offsets or (), item.sizes, label))
        end = bisect.bisect_right(self._waits, self._done, lo=self._next)
        for _, fqn, k in self._ready[self._next : end]:
            self._submit(self._tensors[fqn], k)
        self._next = end

    def _submit(self, t: _Tensor, k: int) -> None:
        size = math.prod(t.shape) * t.dtype.itemsize
        nbytes = min(PIECE, size - k * PIECE)
        source = chunked_source(t.shape, t.dtype.itemsize, t.chunks)
        start = k * PIECE // t.dtype.itemsize
        self.back.piece(t.slots, k, nbytes, self._piece, source, t, start, start + nbytes // t.dtype.itemsize)

    def _piece(self, source: CanonicalSource, t: _Tensor, start: int, stop: int) -> tuple[bytes, Moments]:
        """Elements ``[start, stop)`` of ``t`` read back box by box: their SHA-256 and moments."""
        sha, moments = hashlib.sha256(), Moments()
        for offsets, sizes in run_blocks(t.shape, t.dtype.itemsize, start, stop, _BOX):
            if self.back.stopping:
                break
            buf = source.read(offsets, sizes, self._buffers)
            try:
                sha.update(buf)
                moments.add(t.dtype.name, buf)
            finally:
                self._buffers.give(buf)
        moments.finish(t.dtype.name)
        return sha.digest(), moments

    def manifest(self) -> Manifest:
        """The manifest, once every piece is read back and every file hashed."""
        if self._next != len(self._ready):
            raise AssertionError(f"{len(self._ready) - self._next} pieces were never written")
        pending = [slot for t in self._tensors.values() for slot in t.slots]
        while pending:  # a cancel is heard while they are read
            self._check()
            pending = list(futures.wait(pending, timeout=0.1).not_done)
        self.back.wait()
        self._manifest.files.update(self.back.records())
        return self._manifest
