"""The legacy torch.save format (before torch 1.6): five pickles in a row -- magic number,
protocol, system info, the object, storage keys -- then each storage's element count and bytes."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import IO, Any

from ...errors import CorruptCheckpointError, UnsupportedFormatError
from ...io.raw import read_exact
from ...pickles.guard import scan
from ...pickles.unpicklers import LazyStorages, load_torch_pickle

__all__ = ["read_legacy"]

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def read_legacy(
    f: IO[bytes], local: bool, label: str, storages: LazyStorages, trust: bool
) -> tuple[Any, dict[str, tuple[int, int, int | None]], bool]:
    """The object (tensors as refs over ``storages``), where each storage's bytes are (offset,
    size, no CRC) and whether they are big-endian. ``local``: ``f`` can be memory-mapped."""
    size = f.seek(0, os.SEEK_END)
    pos = 0
    big_endian = False
    scratch = LazyStorages()
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if local else _Whole(f) as data:

        def next_pickle(into: LazyStorages, trusted: bool = False) -> Any:
            nonlocal pos
            end = scan(data, label, pos).end
            value = load_torch_pickle(bytes(data[pos:end]), label, into, trust=trusted)
            pos = end
            return value

        if next_pickle(scratch) != _LEGACY_MAGIC:
            raise UnsupportedFormatError(f"{label}: a pickle, but not a torch.save file")
        if next_pickle(scratch) != _LEGACY_PROTOCOL:
            raise UnsupportedFormatError(f"{label}: unsupported legacy torch.save protocol")
        sys_info = next_pickle(scratch)
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            big_endian = True
        obj = next_pickle(storages, trust)
        keys = next_pickle(scratch)
    if not isinstance(keys, list):
        raise CorruptCheckpointError(f"{label}: damaged legacy storage list")
    locations: dict[str, tuple[int, int, int | None]] = {}
    for key in keys:
        ref = storages.refs.get(str(key))
        if ref is None:
            raise CorruptCheckpointError(f"{label}: storage {key} is not referenced by the pickle")
        count = bytearray(8)
        read_exact(f, pos, memoryview(count), label)
        (numel,) = struct.unpack("<q", count)
        nbytes = numel * ref.dtype.itemsize
        if numel < ref.numel or pos + 8 + nbytes > size:
            raise CorruptCheckpointError(f"{label}: storage {key} is truncated")
        locations[ref.key] = (pos + 8, nbytes, None)
        pos += 8 + nbytes
    missing = set(storages.refs) - set(locations)
    if missing:
        raise CorruptCheckpointError(f"{label}: storages {sorted(missing)[:3]} have no data")
    return obj, locations, big_endian


class _Whole(contextlib.AbstractContextManager["_Whole"]):
    """An in-memory archive's bytes, where a file would be memory-mapped."""

    def __init__(self, f: IO[bytes]) -> None:
        f.seek(0)
        self._data = f.read()

    def __enter__(self) -> Any:
        return self._data

    def __exit__(self, *exc: object) -> None:
        self._data = b""
