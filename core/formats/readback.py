"""A local output's manifest computed from the output's own bytes, read back from the page cache
on worker threads while the writer goes on.

Writing through the hasher (:class:`~.manifest.HashingFile`, :func:`~.manifest.tapped`) puts every
byte through userspace on the writer's thread and gives up ``copy_file_range``: a conversion took
four times as long. Here the writer keeps copying in the kernel; once a tensor's bytes are in the
file, each of its 16 MiB pieces is read back and reduced (SHA-256 and moments, :mod:`.digest`) on
one of two threads, and a third hashes each file in order for its SHA-256, while the next tensor
is written and while the file is fsynced (hashlib and numpy release the GIL). Reads go through a
1 MiB buffer per thread (mapping the pages counted every page of the output in the process's
RSS); the writer waits when more than 1 GiB is written but not yet read back, so what is read
back is still in the page cache and memory stays bounded. What is recorded is what the file holds.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io.raw import pread_into
from .digest import PIECE, Moments
from .manifest import tensor_record

__all__ = ["ReadBack"]

_READ = 1 << 20
_LAG = 1 << 30
_local = threading.local()


def _buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(_READ))
    return buf


def _pieces(fd: int, start: int, end: int, label: str, stop: threading.Event) -> Any:
    """The bytes ``[start, end)`` of the file, read into this thread's buffer a part at a time."""
    buf = _buffer()
    for at in range(start, end, _READ):
        if stop.is_set():
            return
        n = min(_READ, end - at)
        if pread_into(fd, buf[:n], at) < n:
            raise OSError(f"{label}: the output ended early while it was read back")
        yield buf[:n]


@dataclass
class _File:
    path: Path
    fd: int
    start: int
    hashed: int
    sha: Any = field(default_factory=hashlib.sha256)


class ReadBack:
    """Digests and moments of the tensors and SHA-256 of the files of one output, from the files.

    Call :meth:`file` for each output file when it is created, :meth:`tensor` once a tensor's bytes
    are in it, :meth:`advance` as it grows; :meth:`wait` before reading the results; use it as a
    context manager so its threads and descriptors end with the write, failed or not."""

    def __init__(self) -> None:
        self._taps = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcpstudio-digest")
        self._chain = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstudio-sha256")
        self._pending: deque[tuple[Future[Any], int]] = deque()
        self._lag = 0
        self._tensors: list[tuple[dict[str, Any], str, str, tuple[int, ...], list[Future[Any]]]] = []
        self._stop = threading.Event()  # a failed or cancelled write does not wait for a big tensor's hash
        self.files: list[_File] = []

    def __enter__(self) -> ReadBack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the threads (work not finished is dropped) and close the files."""
        self._stop.set()
        for pool in (self._taps, self._chain):
            pool.shutdown(wait=True, cancel_futures=True)
        for file in self.files:
            if file.fd >= 0:
                os.close(file.fd)
        self.files.clear()

    def file(self, path: Path, start: int = 0) -> _File:
        """Follow ``path`` (just created), its SHA-256 over its bytes from ``start`` on."""
        file = _File(path, os.open(path, os.O_RDONLY), start, start)
        self.files.append(file)
        return file

    def done(self, file: _File) -> None:
        """``file`` is complete (its last :meth:`advance` given): its descriptor is closed once it
        is hashed, so an output of thousands of files holds few open (the usual limit is 1,024)."""
        self._chain.submit(self._release, file)

    @staticmethod
    def _release(file: _File) -> None:
        if file.fd >= 0:
            os.close(file.fd)
            file.fd = -1

    def _submit(self, pool: ThreadPoolExecutor, nbytes: int, fn: Any, *args: Any) -> Future[Any]:
        """Queue ``fn``; first wait while more than 1 GiB written is not yet read back."""
        while self._lag > _LAG and self._pending:
            fut, n = self._pending.popleft()
            fut.result()
            self._lag -= n
        fut = pool.submit(fn, *args)
        self._pending.append((fut, nbytes))
        self._lag += nbytes
        return fut

    def _piece(self, fd: int, at: int, n: int, dtype: str, label: str) -> tuple[bytes, Moments]:
        sha, moments = hashlib.sha256(), Moments()
        for part in _pieces(fd, at, at + n, label, self._stop):
            sha.update(part)
            moments.add(dtype, part)
        moments.finish(dtype)
        return sha.digest(), moments

    def tensor(
        self, file: _File, f: Any, at: int, nbytes: int, dtype: str, shape: tuple[int, ...],
        into: dict[str, Any], name: str,
    ) -> None:  # fmt: skip
        """The tensor whose ``nbytes`` canonical bytes ``f`` now holds from ``at``: its record goes
        to ``into[name]`` (after :meth:`wait`)."""
        f.flush()
        into[name] = {}  # the records keep the order the tensors were written in
        pieces = []
        for k in range(0, nbytes, PIECE):
            n = min(PIECE, nbytes - k)
            pieces.append(self._submit(self._taps, n, self._piece, file.fd, at + k, n, dtype, name))
        self._tensors.append((into, name, dtype, tuple(shape), pieces))
        self.advance(file, f)

    def expect(self, into: dict[str, Any], name: str, dtype: str, shape: tuple[int, ...], pieces: int) -> list[Any]:
        """A tensor whose ``pieces`` 16 MiB pieces are reduced by the caller's functions, given to
        :meth:`piece` in any order as their bytes come in (a tensor cut into chunks in several
        files, :mod:`~...ops.convert.reshard`); its record goes to ``into[name]`` after :meth:`wait`."""
        into[name] = {}
        slots: list[Any] = [None] * pieces
        self._tensors.append((into, name, dtype, tuple(shape), slots))
        return slots

    def piece(self, slots: list[Any], k: int, nbytes: int, fn: Any, *args: Any) -> None:
        """Piece ``k`` of an :meth:`expect`-ed tensor: ``fn(*args)`` returns its SHA-256 digest and
        :class:`~.digest.Moments` (finished), run on one of the two threads."""
        slots[k] = self._submit(self._taps, nbytes, fn, *args)

    @property
    def stopping(self) -> bool:
        """Whether the write failed or was cancelled: a piece function stops reading."""
        return self._stop.is_set()

    def advance(self, file: _File, f: Any) -> None:
        """Hash ``file`` up to what ``f`` holds now."""
        f.flush()
        start, end = file.hashed, f.tell()
        file.hashed = end

        def run() -> None:
            for piece in _pieces(file.fd, start, end, str(file.path), self._stop):
                file.sha.update(piece)

        if end > start:
            self._submit(self._chain, end - start, run)

    def wait(self) -> None:
        """Every record computed (the first failure raised)."""
        while self._pending:
            self._pending.popleft()[0].result()
        self._lag = 0
        for into, name, dtype, shape, pieces in self._tensors:
            into[name] = tensor_record(dtype, shape, [p.result() for p in pieces])
        self._tensors.clear()

    def records(self) -> dict[str, dict[str, Any]]:
        """Each file's name, size and SHA-256 of what was hashed (after :meth:`wait`)."""
        return {f.path.name: {"size": f.hashed - f.start, "sha256": f.sha.hexdigest()} for f in self.files}
