"""The manifest DCP Studio writes with every checkpoint: each tensor's content digest and moments
and each file's size and SHA-256, so a checkpoint can be checked and two can be compared without a
reference and without reading tensor data.

A tensor's digest is :mod:`.digest`'s (``sha256-tree``: SHA-256 over the canonical header and the
SHA-256 of each 16 MiB piece of its row-major, little-endian bytes) -- the one definition
:mod:`~...ops.integrity.digests` uses, so a digest recorded while writing equals a later
``dcpstudio hash``. :class:`TensorTap` is fed those bytes piece by piece (by a writer as it writes
them, or by ``hash``), with the moments of the finite values and the NaN/Inf counts beside;
:class:`~.readback.ReadBack` computes the same from a local output's own pages, piece by piece on
two threads. :class:`HashingFile` hashes every byte written to a remote output, in order, while it
is written: no second pass.

Where it lives: a DCP directory's ``dcpstudio-manifest.json``; a safetensors file's
``__metadata__["dcpstudio.manifest"]`` (a JSON string: safetensors metadata holds strings), with its
file recorded by the SHA-256 of its data section (the header holds the manifest itself); a sharded
safetensors set's index ``metadata``; a torch.save file's own record
``<archive>/.data/dcpstudio-manifest.json`` (torch's readers ignore records they do not ask for),
with the file recorded by the SHA-256 of everything before that record (``data_end``). For a
checkpoint DCP Studio did not write, ``hash --manifest`` writes a sidecar ``<file>.manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..io.pipeline import prefetch
from ..io.raw import FileRange, pread_into
from .digest import ALGORITHM, PIECE, Moments, TreeHasher, canonical_header, root_digest

__all__ = ["ALGORITHM", "MANIFEST_FILE", "METADATA_KEY", "PIECE", "ZIP_RECORD", "HashingFile", "Manifest", "TensorTap",
           "canonical_header", "sidecar_of", "tapped", "tensor_record"]  # fmt: skip

MANIFEST_FILE = "dcpstudio-manifest.json"
METADATA_KEY = "dcpstudio.manifest"
ZIP_RECORD = ".data/dcpstudio-manifest.json"  # inside a torch.save archive's folder
SCHEMA = 1
_WIDEST = -1.7976931348623157e308  # the longest repr a float64 has: what a reserved header allows for


def sidecar_of(path: str | os.PathLike[str]) -> Path:
    """Where a manifest written beside a checkpoint goes: inside a directory, next to a file."""
    p = Path(path)
    return p / MANIFEST_FILE if p.is_dir() else p.with_name(p.name + ".manifest.json")


class TensorTap:
    """A tensor's digest and moments from its canonical row-major bytes fed in order by
    :meth:`update` (pieces whose sizes are multiples of the element size). With ``pool``, whole
    16 MiB pieces are hashed there: wait for the futures :meth:`update` returns before reusing
    the buffer; ``total``, the tensor's byte count, sizes a piece gathered across updates."""

    def __init__(
        self, dtype: str, shape: tuple[int, ...], *, moments: bool = True, pool: Any = None, total: int | None = None
    ) -> None:
        self.dtype, self.shape = dtype, tuple(shape)
        self._h = TreeHasher(canonical_header(dtype, self.shape), pool, total)
        self._moments = Moments() if moments else None

    def update(self, data: memoryview | bytes | bytearray) -> list[Any]:
        data = memoryview(data).cast("B")
        futures = self._h.update(data)
        if self._moments is not None and data.nbytes:
            self._moments.add(self.dtype, data)
        return futures

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"digest": self._h.digest(), "dtype": self.dtype, "shape": list(self.shape)}
        if self._moments is not None:
            self._moments.finish(self.dtype)
            out.update(self._moments.record())
        return out


def tensor_record(dtype: str, shape: tuple[int, ...], pieces: list[tuple[bytes, Moments]]) -> dict[str, Any]:
    """A tensor's manifest record from its pieces' SHA-256 digests and moments, in order."""
    moments = Moments()
    for _, m in pieces:
        moments.merge(m)
    digest = root_digest(canonical_header(dtype, shape), (d for d, _ in pieces))
    return {"digest": digest, "dtype": dtype, "shape": list(shape), **moments.record()}


_PIECE = 32 << 20


def tapped(data: FileRange | memoryview | bytes | bytearray, tap: TensorTap, label: str) -> Any:
    """The bytes of a writer's payload in pieces of at most 32 MiB, each fed to ``tap`` on a
    helper thread (read from its file there, for a :class:`FileRange`) while the one before is
    written: the bytes pass once, through the hasher on their way to the output."""
    nbytes = data.nbytes if isinstance(data, FileRange) else memoryview(data).nbytes

    def piece(at: int) -> memoryview:
        n = min(_PIECE, nbytes - at)
        if isinstance(data, FileRange):
            buf = memoryview(bytearray(n))
            if pread_into(data.fd, buf, data.start() + at) < n:
                raise CorruptCheckpointError(f"{label}: the file ends early (truncated?)")
        else:
            buf = memoryview(data).cast("B")[at : at + n]
        tap.update(buf)
        return buf

    for _, buf in prefetch(piece, range(0, nbytes, _PIECE)):
        yield buf


class HashingFile:
    """A binary output file that hashes (SHA-256) what is written to it, in order. Bytes must be
    written sequentially; writing elsewhere (a seek back) makes :meth:`sha256` refuse."""

    def __init__(self, f: Any) -> None:
        self._f = self.raw = f
        self.name = getattr(f, "name", "")
        self.restart()

    def restart(self) -> None:
        """Hash from here on (a safetensors file's data section, after its header)."""
        self._sha = hashlib.sha256()
        self._at = self.start = self._f.tell()
        self._sequential = True

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        if self._f.tell() != self._at:
            self._sequential = False
        self._sha.update(mv)
        n = self._f.write(mv)
        self._at += mv.nbytes
        return n

    def sha256(self) -> str:
        if not self._sequential:
            raise ValueError("a hashed file was not written in order")
        return self._sha.hexdigest()

    def tell(self) -> int:
        return int(self._f.tell())

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._f.seek(offset, whence))

    def flush(self) -> None:
        self._f.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@dataclass
class Manifest:
    """``tensors``: name -> digest record (:meth:`TensorTap.record`) or ``{"digest"}`` for a value;
    ``files``: relative path -> ``{"size", "sha256"}``, or ``{"size", "data_offset", "data_sha256"}``
    for a safetensors file whose header holds the manifest."""

    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "algorithm": ALGORITHM, "piece": PIECE, "files": self.files, "entries": self.tensors}

    def dumps(self) -> str:
        return json.dumps(self.json(), separators=(",", ":"), sort_keys=False)

    @classmethod
    def loads(cls, text: str, label: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("schema") != SCHEMA or raw.get("algorithm") != ALGORITHM:
                raise ValueError(f"schema {raw.get('schema')!r} / {raw.get('algorithm')!r}")
            files, entries = raw["files"], raw["entries"]
            if not isinstance(files, dict) or not isinstance(entries, dict):
                raise ValueError("files and entries must be objects")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{label}: not a DCP Studio manifest ({e})") from None
        return cls(entries, files)

    @staticmethod
    def reserve(names: list[tuple[str, str, tuple[int, ...]]], files: list[str]) -> int:
        """An upper bound of the length, as a JSON string inside a JSON header, of the manifest of
        these tensors and files: what a safetensors writer reserves before the values are known."""
        worst = Manifest(
            {
                n: {
                    "digest": root_digest(b"", ()),
                    "dtype": d,
                    "shape": list(s),
                    **dict.fromkeys(("min", "max", "mean", "std", "nan", "inf"), _WIDEST),
                }
                for n, d, s in names
            },
            {f: {"size": 2**63, "data_offset": 2**63, "data_sha256": "0" * 64} for f in files},
        )
        return len(json.dumps(worst.dumps()))
