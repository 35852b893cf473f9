"""safetensors files read in place: the JSON header gives each tensor's dtype, shape and bytes.

A checkpoint is one ``.safetensors`` file, a directory of shards with
``model.safetensors.index.json``, or that index file itself. Headers are parsed with strict
bounds checks (a hostile header cannot make us allocate or seek outside the file).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..dtypes import BY_SAFETENSORS, NO_TORCH_DTYPE, DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..io.files import file_size, member_path, open_regular, read_regular, sync_file
from ..io.raw import FileRange, copy_range, read_exact
from ..io.remote.locations import as_location

__all__ = [
    "SHARDING_KEY",
    "SafetensorsTensor",
    "SafetensorsWriter",
    "header_shape",
    "parse_header",
    "read_safetensors_header",
    "read_safetensors_index",
    "safetensors_files",
]

_MAX_HEADER = 100_000_000  # the safetensors library's limit
_MAX_DEPTH = 128  # serde_json's nesting limit, which the library keeps
_U64 = (1 << 64) - 1


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
    header = _decode(raw, label)
    start_of_data = base + 8 + n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{label}: the safetensors __metadata__ is not a map of strings")
    sharding = _sharding(meta, label)
    tensors = []
    for name, spec in header.items():
        dtype, shape, (start, end) = _spec(name, spec, label)
        nbytes = _nbytes(shape, dtype, name, label)
        if end - start != nbytes:
            raise CorruptCheckpointError(f"{label}: data range of {name!r} does not hold its {nbytes} bytes")
        offsets = sharding.get(name, (0,) * len(shape))
        if len(offsets) != len(shape):
            raise CorruptCheckpointError(f"{label}: {SHARDING_KEY} of {name!r} does not match its shape")
        tensors.append(SafetensorsTensor(name, path, dtype, shape, start_of_data + start, nbytes, offsets))
    covered = 0
    for t in sorted(tensors, key=lambda t: (t.data_offset, t.data_offset + t.nbytes)):
        if t.data_offset != start_of_data + covered:
            raise CorruptCheckpointError(f"{label}: the data of {t.name!r} does not start where the previous ends")
        covered += t.nbytes
    if start_of_data + covered != size:
        raise CorruptCheckpointError(
            f"{label}: the tensors' data ends at byte {start_of_data + covered}, the file at {size} "
            "(truncated, or not safetensors)"
        )
    return tensors, meta


class _Refused(ValueError):
    """A JSON value the safetensors library's parser (serde_json) does not accept."""


def _integer(text: str) -> int | float:
    """What serde_json makes of a JSON integer: an integer while one fits, else a float (never
    ``int()`` on thousands of digits, whose limit raises a bare ValueError)."""
    return int(text) if len(text) <= 20 and not text.startswith("-") else _float(text)


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused("number out of range")
    return value


def _constant(text: str) -> None:
    raise _Refused(f"{text} is not JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Refused("duplicate key")  # the library keeps the last; we refuse the ambiguity
    return out


def _decode(raw: bytes | bytearray, label: str) -> dict[str, Any]:
    """The header as JSON the way the safetensors library reads it: strict UTF-8, no NaN or
    Infinity, numbers it can hold, strings without lone surrogates, nesting under 128 deep."""
    try:
        header = json.loads(
            raw.decode("utf-8"),
            parse_int=_integer,
            parse_float=_float,
            parse_constant=_constant,
            object_pairs_hook=_unique,
        )
        _check_tree(header)
    except (UnicodeError, ValueError, RecursionError) as e:
        reason = str(e) if isinstance(e, _Refused) else type(e).__name__
        raise CorruptCheckpointError(f"{label}: damaged safetensors header ({reason})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{label}: safetensors header is not a JSON object")
    return header


def _check_tree(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")  # a lone surrogate escape raises
        elif isinstance(item, (dict, list)):
            if depth >= _MAX_DEPTH:
                raise _Refused(f"nested {_MAX_DEPTH} deep")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def _spec(name: str, spec: Any, label: str) -> tuple[DType, tuple[int, ...], tuple[int, int]]:
    """A tensor entry's dtype, shape and data offsets: sizes and offsets non-negative integers
    below 2**63 (what torch can index), as lists -- the library's rules, and ours for size."""
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
        raise CorruptCheckpointError(f"{label}: bad header entry for {name!r} (needs dtype, shape, data_offsets)")
    shape, offsets = spec["shape"], spec["data_offsets"]
    for what, value in (("shape", shape), ("data_offsets", offsets)):
        if not isinstance(value, list) or not all(type(v) is int and 0 <= v < 1 << 63 for v in value):
            raise CorruptCheckpointError(
                f"{label}: the {what} of {name!r} is not a list of non-negative integers below 2**63"
            )
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CorruptCheckpointError(f"{label}: the data_offsets of {name!r} are not a [start, end] pair")
    code = spec["dtype"]
    dtype = BY_SAFETENSORS.get(code) if isinstance(code, str) else None
    if dtype is None:
        kind = NO_TORCH_DTYPE.get(code) if isinstance(code, str) else None
        why = f"a {kind}, which torch has no dtype for" if kind else "not read here"
        raise UnsupportedFormatError(f"{label}: {name!r} has the dtype {str(code)[:40]!r}, {why}")
    if dtype.pack > 1:  # F4 counts 4-bit elements; torch's float4_e2m1fn_x2 holds two a byte
        if not shape or shape[-1] % dtype.pack:
            raise UnsupportedFormatError(
                f"{label}: {name!r} is {code} of shape {shape}; torch's {dtype.name} needs a last dimension "
                f"divisible by {dtype.pack} (as the safetensors library reads it)"
            )
        shape = [*shape[:-1], shape[-1] // dtype.pack]
    return dtype, tuple(shape), (offsets[0], offsets[1])


def header_shape(name: str, dtype: DType, shape: tuple[int, ...]) -> list[int]:
    """The shape a safetensors header records for a torch tensor: elements as the library counts
    them (``F4``: two per ``float4_e2m1fn_x2`` byte, along the last dimension)."""
    if dtype.pack == 1:
        return list(shape)
    if not shape:
        raise UnsupportedFormatError(
            f"safetensors cannot store the scalar {dtype} {name!r}: its {dtype.safetensors} elements are "
            "counted along a last dimension"
        )
    return [*shape[:-1], shape[-1] * dtype.pack]


def _nbytes(shape: tuple[int, ...], dtype: DType, name: str, label: str) -> int:
    """Bytes of the tensor, refused where the library's 64-bit product of sizes (then of bits)
    overflows, even when a later size of 0 would bring it back."""
    numel = 1
    for s in shape:
        numel *= s
        if numel > _U64:
            break
    if numel * dtype.itemsize * 8 > _U64:
        raise CorruptCheckpointError(f"{label}: the shape of {name!r} overflows a 64-bit size")
    return numel * dtype.itemsize


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


def read_safetensors_header(path: Path) -> tuple[list[SafetensorsTensor], dict[str, str]]:
    """One safetensors file's tensors and ``__metadata__``, every range checked (:func:`parse_header`)."""
    with open_regular(path) as f:
        return parse_header(f, path, str(path))


def safetensors_files(path: str | os.PathLike[str]) -> tuple[list[Any], dict[str, Any]]:
    """The files of a safetensors checkpoint (single file, sharded directory or index file), each
    checked to lie inside it, and ``{"index": ..., "weight_map": ...}`` when an index names them."""
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
            info["index"], info["weight_map"] = str(index), data["weight_map"]
        else:
            files = sorted(member_path(root, f.name, "safetensors file") for f in root.glob("*.safetensors"))
    else:
        files = [p]
    return files, info


def read_safetensors_index(path: str | os.PathLike[str]) -> tuple[list[SafetensorsTensor], dict[str, Any]]:
    """All tensors of a safetensors checkpoint (single file, sharded directory or index file)."""
    files, info = safetensors_files(path)
    info.pop("weight_map", None)
    tensors: list[SafetensorsTensor] = []
    for f in files:
        if not f.is_file():
            raise CorruptCheckpointError(f"{f}: listed in the index but missing")
        found, meta = read_safetensors_header(f)
        tensors += found
        if meta:
            info.setdefault("metadata", {})[f.name] = meta
    return tensors, info


class SafetensorsWriter:
    """Streams one safetensors file: the header (all names, dtypes, shapes and offsets) first,
    then each tensor's bytes in header order -- from memory or copied from another file."""

    def __init__(
        self, f: Any, tensors: list[tuple[str, DType, tuple[int, ...]]], metadata: dict[str, str], reserve: int = 0
    ) -> None:
        header: dict[str, Any] = {}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for name, dtype, shape in tensors:
            if dtype.safetensors is None:
                raise UnsupportedFormatError(f"safetensors cannot store {dtype} (tensor {name})")
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * dtype.itemsize
            header[name] = {
                "dtype": dtype.safetensors,
                "shape": header_shape(name, dtype, shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((name, nbytes))
            offset += nbytes
        self._header, self._metadata = header, dict(metadata)
        raw = self._raw() + b" " * reserve  # room for metadata known only at the end (set_metadata)
        raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned, as safetensors writes it
        self._f = f
        self._next = 0
        self._start = f.tell()
        self.header_size = len(raw)
        f.write(struct.pack("<Q", len(raw)) + raw)

    def _raw(self) -> bytes:
        header = {"__metadata__": self._metadata, **self._header} if self._metadata else self._header
        return json.dumps(header, separators=(",", ":")).encode()

    def set_metadata(self, key: str, value: str) -> None:
        """Put ``key`` into ``__metadata__`` after the data is written, in the room reserved for it
        (the header keeps its length: spaces pad it, as safetensors allows)."""
        self._metadata[key] = value
        raw = self._raw()
        if len(raw) > self.header_size:
            raise ValueError("safetensors writer: the metadata outgrew the room reserved for it")
        end = self._f.tell()
        self._f.seek(self._start + 8)
        self._f.write(raw + b" " * (self.header_size - len(raw)))
        self._f.seek(end)

    def stream(self, name: str, nbytes: int, pieces: Any) -> None:
        """Write a tensor's bytes as they come, piece by piece."""
        self._take(name, nbytes)
        written = 0
        for piece in pieces:
            written += memoryview(piece).nbytes
            self._f.write(piece)
        if written != nbytes:
            raise ValueError(f"safetensors writer: {written} bytes of {name}, the header says {nbytes}")

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
