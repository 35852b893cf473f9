"""The manifest DCP Studio writes with every checkpoint: each tensor's content digest and moments
and each file's size and SHA-256, so a checkpoint can be checked and two can be compared without a
reference and without reading tensor data.

A tensor's digest is BLAKE2b-256 over its canonical bytes -- ``tensor\\0DTYPE\\0SHAPE\\0`` and then
its elements row-major, little-endian -- the one function :mod:`~...ops.integrity.digests` uses, so a
digest recorded while writing equals a later ``dcpstudio hash``. :class:`TensorTap` is fed those
bytes piece by piece (by a writer as it writes them, or by ``hash``), and keeps the moments of the
finite values (numpy, no torch) and the NaN/Inf counts beside. :class:`HashingFile` hashes every
byte written to an output file, in order, while it is written: no second pass.

Where it lives: a DCP directory's ``dcpstudio-manifest.json``; a torch.save file's sidecar
``<file>.manifest.json``; a safetensors file's ``__metadata__["dcpstudio.manifest"]`` (a JSON
string: safetensors metadata holds strings), with its file recorded by the SHA-256 of its data
section (the header holds the manifest itself); a sharded safetensors set's index ``metadata``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..io.pipeline import prefetch
from ..io.raw import FileRange, pread_into

__all__ = ["ALGORITHM", "MANIFEST_FILE", "METADATA_KEY", "HashingFile", "Manifest", "TensorTap", "canonical_header",
           "named", "new_hasher", "sidecar_of", "tapped"]  # fmt: skip

ALGORITHM = "blake2b-256"
MANIFEST_FILE = "dcpstudio-manifest.json"
METADATA_KEY = "dcpstudio.manifest"
SCHEMA = 1
_WIDEST = -1.7976931348623157e308  # the longest repr a float64 has: what a reserved header allows for


def new_hasher() -> Any:
    return hashlib.blake2b(digest_size=32)


def named(h: Any) -> str:
    return f"{ALGORITHM}:{h.hexdigest()}"


def canonical_header(dtype: str, shape: tuple[int, ...] | list[int]) -> bytes:
    return f"tensor\0{dtype}\0{','.join(map(str, shape))}\0".encode()


def sidecar_of(path: str | os.PathLike[str]) -> Path:
    """Where a manifest written beside a checkpoint goes: inside a directory, next to a file."""
    p = Path(path)
    return p / MANIFEST_FILE if p.is_dir() else p.with_name(p.name + ".manifest.json")


def _numpy_view(dtype: str, data: memoryview) -> Any:
    """The elements of ``data`` as a numpy array numpy can reduce, or None (float8, complex, ...)."""
    import numpy as np

    simple = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "bool": "u1", "int8": "i1", "uint8": "u1",
              "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint16": "<u2", "uint32": "<u4",
              "uint64": "<u8"}  # fmt: skip
    if dtype in simple:
        return np.frombuffer(data, dtype=simple[dtype])
    if dtype == "bfloat16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return None


_SUB = 1 << 16  # elements per float64 sub-block: 512 KiB, in cache
_local = threading.local()


def _scratch() -> Any:
    """This thread's float64 sub-block, reused: a new array each block costs page faults (fresh
    memory from the kernel) that took longer than the arithmetic."""
    import numpy as np

    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = np.empty(_SUB, dtype=np.float64)
    return buf


class TensorTap:
    """A tensor's digest and moments, from its canonical row-major bytes fed in order by
    :meth:`update` (pieces whose sizes are multiples of the element size)."""

    def __init__(self, dtype: str, shape: tuple[int, ...], *, moments: bool = True) -> None:
        self.dtype, self.shape = dtype, tuple(shape)
        self._h = new_hasher()
        self._h.update(canonical_header(dtype, self.shape))
        self._moments = moments
        self._n = self._nan = self._inf = 0
        self._mean = self._m2 = 0.0
        self._min: float | None = None
        self._max: float | None = None
        self._numeric = True

    def update(self, data: memoryview | bytes | bytearray) -> None:
        data = memoryview(data).cast("B")
        self._h.update(data)
        if self._moments and self._numeric and data.nbytes:
            self._reduce(data)

    def _reduce(self, data: memoryview) -> None:
        import numpy as np

        x = _numpy_view(self.dtype, data)
        if x is None:
            self._numeric = False
            return
        if x.dtype.kind == "f":
            lo, hi = x.min(), x.max()
            if not (math.isfinite(lo) and math.isfinite(hi)):
                nan = np.isnan(x)
                inf = np.isinf(x)
                self._nan += int(nan.sum())
                self._inf += int(inf.sum())
                x = x[~(nan | inf)]
                if not x.size:
                    return
                lo, hi = x.min(), x.max()
        else:
            lo, hi = x.min(), x.max()
        exact = x.dtype.kind in "iu"
        lo, hi = (int(lo), int(hi)) if exact else (float(lo), float(hi))
        self._min = lo if self._min is None else min(self._min, lo)
        self._max = hi if self._max is None else max(self._max, hi)
        scratch = _scratch()
        for start in range(0, x.size, _SUB):
            part = x[start : start + _SUB]
            n = part.size
            b = scratch[:n]
            b[...] = part
            mean = float(b.sum()) / n
            b -= mean
            m2 = float(np.einsum("i,i->", b, b))  # not BLAS: its threads spin, burning both cores
            total = self._n + n
            delta = mean - self._mean
            self._mean += delta * n / total
            self._m2 += m2 + delta * delta * self._n * n / total
            self._n = total

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"digest": named(self._h), "dtype": self.dtype, "shape": list(self.shape)}
        if self._moments and self._numeric:
            finite = self._n > 0
            out.update(
                min=self._min,
                max=self._max,
                mean=self._mean if finite else None,
                std=math.sqrt(self._m2 / self._n) if finite else None,
                nan=self._nan,
                inf=self._inf,
            )
        return out


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
        return {"schema": SCHEMA, "algorithm": ALGORITHM, "files": self.files, "entries": self.tensors}

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
                    "digest": named(new_hasher()),
                    "dtype": d,
                    "shape": list(s),
                    **dict.fromkeys(("min", "max", "mean", "std", "nan", "inf"), _WIDEST),
                }
                for n, d, s in names
            },
            {f: {"size": 2**63, "data_offset": 2**63, "data_sha256": "0" * 64} for f in files},
        )
        return len(json.dumps(worst.dumps()))
