"""A local output's manifest computed from the output's own bytes, read back from the page cache
on worker threads while the writer goes on.

Writing through the hasher (:class:`~.manifest.HashingFile`, :func:`~.manifest.tapped`) puts every
byte through userspace on the writer's thread and gives up ``copy_file_range``: a conversion took
four times as long. Here the writer keeps copying in the kernel; once a tensor's bytes are in the
file, two threads (hashlib and numpy release the GIL) read them back and compute its digest and
moments, and a third hashes each file in order for its SHA-256, while the next tensor is written
and while the file is fsynced. The bytes still leave the disk once, and what is recorded is what
the file holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .manifest import TensorTap

__all__ = ["ReadBack"]

_PIECE = 8 << 20
_GRAIN = mmap.ALLOCATIONGRANULARITY


def _pieces(fd: int, start: int, end: int, label: str, stop: threading.Event) -> Any:
    """The bytes ``[start, end)`` of the file in pieces mapped from the page cache (no copy: a
    read into a buffer cost as much CPU as the SHA-256), each unmapped once the next is asked for."""
    if os.fstat(fd).st_size < end:  # a mapping past the end would kill the process (SIGBUS) when read
        raise OSError(f"{label}: the output ended early while it was read back")
    for at in range(start, end, _PIECE):
        if stop.is_set():
            return
        base = at - at % _GRAIN
        n = min(_PIECE, end - at)
        m = mmap.mmap(fd, at + n - base, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=base)
        view = memoryview(m)[at - base :]
        try:
            yield view
        finally:
            with contextlib.suppress(BufferError):  # a view still held (a traceback's): unmapped with it
                view.release()
                m.close()


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # the pages mapped at once, not faulted in one by one


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
        self._pending: list[Future[None]] = []
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
            os.close(file.fd)
        self.files.clear()

    def file(self, path: Path, start: int = 0) -> _File:
        """Follow ``path`` (just created), its SHA-256 over its bytes from ``start`` on."""
        file = _File(path, os.open(path, os.O_RDONLY), start, start)
        self.files.append(file)
        return file

    def tensor(
        self, file: _File, f: Any, at: int, nbytes: int, tap: TensorTap, into: dict[str, Any], name: str
    ) -> None:
        """The tensor whose ``nbytes`` canonical bytes ``f`` now holds from ``at``: its record
        (``tap``'s) goes to ``into[name]``."""
        f.flush()

        def run() -> None:
            for piece in _pieces(file.fd, at, at + nbytes, name, self._stop):
                tap.update(piece)
            into[name] = tap.record()

        into[name] = {}  # the records keep the order the tensors were written in
        self._pending.append(self._taps.submit(run))
        self.advance(file, f)

    def advance(self, file: _File, f: Any) -> None:
        """Hash ``file`` up to what ``f`` holds now."""
        f.flush()
        start, end = file.hashed, f.tell()
        file.hashed = end

        def run() -> None:
            for piece in _pieces(file.fd, start, end, str(file.path), self._stop):
                file.sha.update(piece)

        if end > start:
            self._pending.append(self._chain.submit(run))

    def wait(self) -> None:
        """Every record computed (the first failure raised)."""
        for fut in self._pending:
            fut.result()
        self._pending.clear()

    def records(self) -> dict[str, dict[str, Any]]:
        """Each file's name, size and SHA-256 of what was hashed (after :meth:`wait`)."""
        return {f.path.name: {"size": f.hashed - f.start, "sha256": f.sha.hexdigest()} for f in self.files}
