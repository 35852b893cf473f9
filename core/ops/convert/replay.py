"""A distributed conversion's manifest: the single-process writer's, from digests the ranks computed.

The single-process writer reads its output back (:class:`~...formats.readback.ReadBack`): each
tensor's 16 MiB pieces (SHA-256 and moments) and each file's SHA-256 over a span (a whole DCP data
file, a safetensors file's data section, a torch.save file up to its manifest record). A layout
pass runs that very writer with the tensor bytes left as holes and a :class:`Replay` in the
reader's place: it records where each tensor and each hashed span lies, and -- once the ranks have
written the bytes and computed those digests from the output (:func:`piece_digests`,
:func:`span_digests`, each rank its share: :func:`balance`) -- hands the writer the very records a
read-back would have given, in the order it asks for them. The manifest the writer then lays out
is the single-process one, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...formats.digest import PIECE, Moments
from ...formats.manifest import tensor_record
from ...formats.readback import ReadBack, _File
from ...io.raw import pread_into
from ...io.remote.locations import RemotePath

__all__ = ["Replay", "balance", "piece_digests", "piece_jobs", "span_digests"]

_READ = 1 << 20
_UNKNOWN = "0" * 64  # a file's SHA-256 before the ranks computed it: same length, so the same layout

PieceDigest = tuple[bytes, Moments]


class Replay:
    """What a layout pass's writer asked the reader: ``tensors`` -- ``(file, offset, nbytes, dtype)``
    per tensor recorded, in order; ``spans`` -- ``(file, start, end)`` per hashed file, in order
    (file: the path the writer used). With ``pieces`` (each tensor's piece digests, in order) and
    ``shas`` (each span's SHA-256), the writer gets them as its records; without, placeholders of
    the same layout."""

    def __init__(self, pieces: Sequence[Sequence[PieceDigest]] | None = None, shas: Sequence[str] | None = None):
        self.pieces, self.shas = pieces, shas
        self.tensors: list[tuple[str, int, int, str]] = []
        self.spans: list[list[Any]] = []

    def reader(self) -> ReadBack:
        """The stand-in a writer constructs where it would construct a :class:`ReadBack`."""
        return _Replayed(self)


class _Replayed(ReadBack):
    """A :class:`ReadBack` that reads nothing: the positions go to its :class:`Replay`, and the
    records come from it."""

    def __init__(self, replay: Replay) -> None:  # no threads, no descriptors
        self._replay = replay
        self._named: list[tuple[dict[str, Any], str, str, tuple[int, ...], int]] = []
        self._spans: list[tuple[_File, int]] = []
        self.files: list[_File] = []

    def close(self) -> None:
        self.files.clear()

    def file(self, path: Path, start: int = 0) -> _File:
        file = _File(path, -1, start, start)
        self.files.append(file)
        self._spans.append((file, len(self._replay.spans)))
        self._replay.spans.append([str(path), start, start])
        return file

    def _span(self, file: _File) -> list[Any]:
        return self._replay.spans[next(k for f, k in self._spans if f is file)]

    def tensor(
        self, file: _File, f: Any, at: int, nbytes: int, dtype: str, shape: tuple[int, ...],
        into: dict[str, Any], name: str,
    ) -> None:  # fmt: skip
        into[name] = {}  # the records keep the order the tensors were written in
        self._named.append((into, name, dtype, tuple(shape), len(self._replay.tensors)))
        self._replay.tensors.append((str(file.path), at, nbytes, dtype))
        self.advance(file, f)

    def advance(self, file: _File, f: Any) -> None:
        file.hashed = max(file.hashed, f.tell())
        self._span(file)[2] = file.hashed

    def wait(self) -> None:
        pieces = self._replay.pieces
        for into, name, dtype, shape, k in self._named:
            into[name] = tensor_record(dtype, shape, list(pieces[k]) if pieces is not None else [])
        self._named.clear()

    def records(self) -> dict[str, dict[str, Any]]:
        shas = self._replay.shas
        return {
            f.path.name: {"size": f.hashed - f.start, "sha256": shas[k] if shas is not None else _UNKNOWN}
            for f, k in self._spans
        }


def piece_jobs(tensors: Sequence[tuple[str, int, int, str]]) -> list[tuple[int, str, int, int, str]]:
    """Every tensor's pieces as ReadBack cuts them: ``(tensor, file, offset, nbytes, dtype)``, in order."""
    return [
        (k, name, at + s, min(PIECE, nbytes - s), dtype)
        for k, (name, at, nbytes, dtype) in enumerate(tensors)
        for s in range(0, nbytes, PIECE)
    ]


def balance(sizes: Sequence[int], world: int) -> list[list[int]]:
    """The indices of ``sizes`` shared between ``world`` ranks, the largest first to the least
    loaded (the same on every rank): a file's SHA-256 cannot be split, its tensors' pieces can."""
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += sizes[i]
    return out


def _read(fd: Any, start: int, end: int, label: str, buf: memoryview) -> Any:
    for at in range(start, end, _READ):
        n = min(_READ, end - at)
        if pread_into(fd, buf[:n], at) < n:
            raise OSError(f"{label}: the output ended early while it was read back")
        yield buf[:n]


def _opened(root: Path | RemotePath, name: str, fds: dict[str, Any]) -> Any:
    """The output's file ``name``: a descriptor, or a remote object read by range (an upload's read-back)."""
    fd = fds.get(name)
    if fd is None:
        where = root / name if name else root
        if isinstance(where, RemotePath):
            fd = fds[name] = where.open_read()
        else:
            fd = fds[name] = os.open(where, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    return fd


def _close(fds: dict[str, Any]) -> None:
    for fd in fds.values():
        if isinstance(fd, int):
            os.close(fd)
        else:
            fd.close()


def piece_digests(
    root: Path | RemotePath, jobs: Sequence[tuple[int, str, int, int, str]], check: Callable[[], None] = lambda: None
) -> list[tuple[int, int, PieceDigest]]:
    """``(tensor, offset, (sha256, moments))`` of each piece ``jobs`` names (file names relative to
    the output at ``root``), read from the output as :class:`ReadBack` reads it."""
    buf = memoryview(bytearray(_READ))
    fds: dict[str, Any] = {}
    out = []
    try:
        for k, name, at, n, dtype in jobs:
            check()
            sha, moments = hashlib.sha256(), Moments()
            for part in _read(_opened(root, name, fds), at, at + n, str(root / name), buf):
                sha.update(part)
                moments.add(dtype, part)
            moments.finish(dtype)
            out.append((k, at, (sha.digest(), moments)))
    finally:
        _close(fds)
    return out


def span_digests(
    root: Path | RemotePath, spans: Sequence[tuple[int, str, int, int]], check: Callable[[], None] = lambda: None
) -> list[tuple[int, str]]:
    """``(span, sha256 hex)`` of each ``(span, file, start, end)`` of the output at ``root``."""
    buf = memoryview(bytearray(_READ))
    fds: dict[str, Any] = {}
    out = []
    try:
        for k, name, start, end in spans:
            check()
            sha = hashlib.sha256()
            for part in _read(_opened(root, name, fds), start, end, str(root / name), buf):
                sha.update(part)
            out.append((k, sha.hexdigest()))
    finally:
        _close(fds)
    return out
