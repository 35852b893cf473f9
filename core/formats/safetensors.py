"""safetensors files read in place: the JSON header gives each tensor's dtype, shape and bytes.

A checkpoint is one ``.safetensors`` file, a directory of shards with
``model.safetensors.index.json``, or that index file itself. Headers are parsed with strict
bounds checks (a hostile header cannot make us allocate or seek outside the file).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .._files import file_size, member_path, open_regular, read_regular, sync_file
from .._io import FileRange, copy_range, read_exact
from .._remote import as_location
from ..dtypes import BY_SAFETENSORS, DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError

__all__ = ["SHARDING_KEY", "SafetensorsTensor", "SafetensorsWriter", "parse_header", "read_safetensors_index"]

_MAX_HEADER = 100 << 20


SHARDING_KEY = "DCP_SHARDING_INFO"  # torch's HuggingFaceStorageWriter: where each tensor's shard lies


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors file. ``offsets`` places it in a larger tensor when the file
    holds a shard of it (torch's distributed HF layout: ``DCP_SHARDING_INFO``), else zeros."""

    name: str
    file: Path
    dtype: DType
    shape: tuple[int, ...]
    data_offset: int  # absolute byte offset in ``file``
    nbytes: int
    offsets: tuple[int, ...] = ()


def parse_header(f: IO[bytes], path: Path, label: str, base: int = 0) -> tuple[list[SafetensorsTensor], dict[str, str]]:
    """The tensors of the safetensors data at offset ``base`` of ``f`` (a whole file, or a blob
    inside a DCP data file). Every range is checked against the file's size."""
    try:
        size = file_size(f)
        head = bytearray(8)
        if base + 8 > size:
            raise CorruptCheckpointError(f"{label}: too short for a safetensors file")
        read_exact(f, base, memoryview(head), label)
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - base - 8):
            raise CorruptCheckpointError(f"{label}: header length {n} exceeds the file (truncated or not safetensors)")
        raw = bytearray(n)
        read_exact(f, base + 8, memoryview(raw), label)
    except OSError as e:
        raise UnsupportedFormatError(f"{label}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{label}: damaged safetensors header ({type(e).__name__})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{label}: safetensors header is not a JSON object")
    start_of_data = base + 8 + n
    meta = header.pop("__metadata__", None) or {}
    meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
    sharding = _sharding(meta, label)
    tensors = []
    for name, spec in header.items():
        try:
            dtype = BY_SAFETENSORS[spec["dtype"]]
            shape = tuple(int(s) for s in spec["shape"])
            start, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{label}: bad header entry for {name!r} ({type(e).__name__}: {e})") from e
        numel = 1
        for s in shape:
            if s < 0:
                raise CorruptCheckpointError(f"{label}: negative dimension in {name!r}")
            numel *= s
        nbytes = numel * dtype.itemsize
        if not 0 <= start <= end or end - start != nbytes or start_of_data + end > size:
            raise CorruptCheckpointError(f"{label}: data range of {name!r} is inconsistent or outside the file")
        offsets = sharding.get(name, (0,) * len(shape))
        if len(offsets) != len(shape):
            raise CorruptCheckpointError(f"{label}: {SHARDING_KEY} of {name!r} does not match its shape")
        tensors.append(SafetensorsTensor(name, path, dtype, shape, start_of_data + start, nbytes, offsets))
    return tensors, meta


def _sharding(meta: dict[str, str], label: str) -> dict[str, tuple[int, ...]]:
    raw = meta.get(SHARDING_KEY)
    if raw is None:
        return {}
    try:
        info = json.loads(raw)
        out = {}
        for name, spec in info.items():
            offsets = tuple(spec["saved_offsets"])
            if not all(type(o) is int and o >= 0 for o in offsets):
                raise ValueError("offsets must be non-negative integers")
            out[str(name)] = offsets
        return out
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{label}: damaged {SHARDING_KEY} metadata ({type(e).__name__})") from e


def _read_header(path: Path) -> tuple[list[SafetensorsTensor], dict[str, str]]:
    with open_regular(path) as f:
        return parse_header(f, path, str(path))


def read_safetensors_index(path: str | os.PathLike[str]) -> tuple[list[SafetensorsTensor], dict[str, Any]]:
    """All tensors of a safetensors checkpoint (single file, sharded directory or index file)."""
    p = as_location(path)
    files: list[Any]
    info: dict[str, Any] = {}
    index = p if p.is_file() and p.name.endswith(".index.json") else p / "model.safetensors.index.json"
    if p.is_dir() or p == index:
        root = index.parent
        if index.is_file():
            try:
                data = json.loads(read_regular(index, _MAX_HEADER))
                names = set(data["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CorruptCheckpointError(f"{index}: damaged safetensors index ({e})") from e
            files = sorted(member_path(root, name, "shard named by the safetensors index") for name in names)
            info["index"] = str(index)
        else:
            files = sorted(member_path(root, f.name, "safetensors file") for f in root.glob("*.safetensors"))
    else:
        files = [p]
    tensors: list[SafetensorsTensor] = []
    for f in files:
        if not f.is_file():
            raise CorruptCheckpointError(f"{f}: listed in the index but missing")
        found, meta = _read_header(f)
        tensors += found
        if meta:
            info.setdefault("metadata", {})[f.name] = meta
    return tensors, info


class SafetensorsWriter:
    """Streams one safetensors file: the header (all names, dtypes, shapes and offsets) first,
    then each tensor's bytes in header order -- from memory or copied from another file."""

    def __init__(self, f: Any, tensors: list[tuple[str, DType, tuple[int, ...]]], metadata: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for name, dtype, shape in tensors:
            if dtype.safetensors is None:
                raise UnsupportedFormatError(f"safetensors cannot store {dtype} (tensor {name})")
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * dtype.itemsize
            header[name] = {"dtype": dtype.safetensors, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned, as safetensors writes it
        self._f = f
        self._next = 0
        f.write(struct.pack("<Q", len(raw)) + raw)

    def _take(self, name: str, nbytes: int) -> None:
        want = self._expected[self._next]
        if want != (name, nbytes):
            raise ValueError(f"safetensors writer expected {want}, got {(name, nbytes)}")
        self._next += 1

    def write(self, name: str, data: bytes | bytearray | memoryview) -> None:
        self._take(name, memoryview(data).nbytes)
        self._f.write(data)

    def copy(self, name: str, src: FileRange, label: str) -> None:
        self._take(name, src.nbytes)
        copy_range(src, self._f, label)

    def finish(self) -> None:
        if self._next != len(self._expected):
            raise ValueError("safetensors writer finished before every tensor was written")
        sync_file(self._f)
