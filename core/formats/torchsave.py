"""torch.save files, read lazily and written record by record -- without importing torch.

Reading (:class:`TorchSaveFile`): the pickle is loaded with weights-only semantics into an object
tree whose tensors are :class:`~dcpstudio.core._refs.TensorRef` descriptions; a storage's bytes
are read only when asked for, straight from its record. Opening a multi-GiB file therefore costs
about as much as reading its pickle. Both the ZIP format (torch >= 1.6) and the legacy sequential
format are read. :func:`dcpstudio.core._tensor_io.materialize` makes a torch tensor of a ref.

Writing (:class:`TorchSaveWriter`): the pickle goes first, referencing storages by key, then each
storage's record is appended as its bytes become available, so a whole checkpoint never needs to
be in memory. Files load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import array
import contextlib
import io
import mmap
import os
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from .._files import open_regular
from .._io import FileRange, read_exact, source_of
from .._pickle import LazyStorages, TorchPickler, load_torch_pickle
from .._pickle_guard import scan
from .._refs import StorageRef, TensorRef
from .._remote import RemotePath, as_location
from .._tree import check_depth
from ..dtypes import DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ._zip import ZipRecord, ZipWriter, read_zip_records

__all__ = ["TorchSaveFile", "TorchSaveWriter", "archive_name", "swap_bytes", "write_archive", "write_tensor_archive"]

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_SWAP_CODES = {2: "H", 4: "I", 8: "Q"}


def swap_bytes(data: bytearray, dtype: DType) -> bytearray:
    """Big-endian ``dtype`` elements into native order (complex: each half swapped)."""
    width = dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize
    code = _SWAP_CODES.get(width)
    if code is None or array.array(code).itemsize != width:
        return data
    values = array.array(code)
    values.frombytes(bytes(data))
    values.byteswap()
    return bytearray(values.tobytes())


class TorchSaveFile:
    """A torch.save archive opened without reading tensor data: a file on disk, or an archive
    held in memory (DCP stores each non-tensor value as one). Use as a context manager."""

    def __init__(
        self, path: str | os.PathLike[str] | io.BytesIO, *, trust_pickle: bool = False, label: str = ""
    ) -> None:
        where = as_location(path) if not isinstance(path, io.BytesIO) else None
        self.path = where if where is None or isinstance(where, RemotePath) else Path(where)
        self._local = isinstance(self.path, Path)
        self.label = label or str(path)
        self.storages = LazyStorages(self)
        self._locations: dict[str, tuple[int, int, int | None] | ZipRecord] = {}  # offset, size, CRC
        self._compressed: dict[str, str] = {}
        self._big_endian = False
        self._cache: tuple[str, memoryview] | None = None
        if isinstance(path, io.BytesIO):
            self._f: IO[bytes] = path
        else:
            self._f = open_regular(self.path, self.label)  # type: ignore[arg-type]
        try:
            head = self._read_small(0, min(4, self._size()))
            if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
                self.obj = self._open_zip(trust_pickle)
                self.format = "torch-zip"
            elif head[:1] == b"\x80":
                self.obj = self._open_legacy(trust_pickle)
                self.format = "torch-legacy"
            else:
                raise UnsupportedFormatError(f"{self.label}: not a torch.save file")
            check_depth(self.obj, self.label)
        except BaseException:
            self._f.close()
            raise

    def _size(self) -> int:
        self._f.seek(0, os.SEEK_END)
        return self._f.tell()

    # -- opening -------------------------------------------------------------------------------
    def _open_zip(self, trust: bool) -> Any:
        records = read_zip_records(self._f, self.label)
        pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CorruptCheckpointError(f"{self.label}: ZIP archive without a torch data.pkl; not a torch.save file")
        prefix = pickles[0][: -len("data.pkl")]
        order = records.get(prefix + "byteorder")
        if order is not None:
            self._big_endian = self._read_small(order.data_offset, order.size) == b"big"
        pkl = records[pickles[0]]
        data = self._record_bytes(pkl.name, pkl.data_offset, pkl.size, pkl.stored)
        obj = load_torch_pickle(data, self.label, self.storages, trust=trust)
        for key, ref in self.storages.refs.items():
            rec = records.get(f"{prefix}data/{key}")
            if rec is None:
                raise CorruptCheckpointError(f"{self.label}: storage record data/{key} is missing")
            if rec.size < ref.nbytes:
                raise CorruptCheckpointError(
                    f"{self.label}: storage record data/{key} holds {rec.size} bytes, needs {ref.nbytes}"
                )
            self._locations[key] = rec  # where its bytes start: known when first needed
            if not rec.stored:
                self._compressed[key] = rec.name
        return obj

    def _open_legacy(self, trust: bool) -> Any:
        """Five pickles in a row (magic number, protocol, system info, the object, storage keys),
        then each storage's element count and bytes."""
        size = self._size()
        pos = 0
        scratch = LazyStorages()
        with mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if self._local else _Whole(self._f) as data:

            def next_pickle(storages: LazyStorages, trusted: bool = False) -> Any:
                nonlocal pos
                end = scan(data, self.label, pos).end
                value = load_torch_pickle(bytes(data[pos:end]), self.label, storages, trust=trusted)
                pos = end
                return value

            if next_pickle(scratch) != _LEGACY_MAGIC:
                raise UnsupportedFormatError(f"{self.label}: a pickle, but not a torch.save file")
            if next_pickle(scratch) != _LEGACY_PROTOCOL:
                raise UnsupportedFormatError(f"{self.label}: unsupported legacy torch.save protocol")
            sys_info = next_pickle(scratch)
            if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
                self._big_endian = True
            obj = next_pickle(self.storages, trust)
            keys = next_pickle(scratch)
        if not isinstance(keys, list):
            raise CorruptCheckpointError(f"{self.label}: damaged legacy storage list")
        for key in keys:
            ref = self.storages.refs.get(str(key))
            if ref is None:
                raise CorruptCheckpointError(f"{self.label}: storage {key} is not referenced by the pickle")
            (numel,) = struct.unpack("<q", self._read_small(pos, 8))
            nbytes = numel * ref.dtype.itemsize
            if numel < ref.numel or pos + 8 + nbytes > size:
                raise CorruptCheckpointError(f"{self.label}: storage {key} is truncated")
            self._locations[ref.key] = (pos + 8, nbytes, None)
            pos += 8 + nbytes
        missing = set(self.storages.refs) - set(self._locations)
        if missing:
            raise CorruptCheckpointError(f"{self.label}: storages {sorted(missing)[:3]} have no data")
        return obj

    def _read_small(self, offset: int, size: int) -> bytes:
        buf = bytearray(size)
        read_exact(self._f, offset, memoryview(buf), self.label)
        return bytes(buf)

    def _record_bytes(self, name: str, offset: int, size: int, stored: bool) -> bytes:
        if stored:
            return self._read_small(offset, size)
        try:
            with zipfile.ZipFile(self._f) as zf:
                return zf.read(name)
        except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError, ValueError, zlib.error) as e:
            raise CorruptCheckpointError(f"{self.label}: cannot read record {name} ({e})") from e

    # -- where bytes are -------------------------------------------------------------------------
    def _own(self, ref: StorageRef | None) -> StorageRef:
        if ref is None or ref.archive is not self:
            raise ValueError(f"{self.label}: not a storage of this archive")
        return ref

    def location(self, ref: StorageRef) -> tuple[int, int]:
        """Byte offset and length of a storage's record in the file."""
        offset, size, _crc = self._where(self._own(ref).key)
        return offset, size

    def _where(self, key: str) -> tuple[int, int, int | None]:
        loc = self._locations[key]
        return (loc.data_offset, loc.size, loc.crc) if isinstance(loc, ZipRecord) else loc

    def in_place(self, ref: StorageRef) -> bool:
        """Whether the storage's bytes lie in the file as they are (stored, native byte order)."""
        return ref.key not in self._compressed and not self._big_endian

    def storage_range(self, ref: StorageRef) -> FileRange | None:
        """The storage's bytes in the file (CRC set when the record holds exactly them)."""
        if not self.in_place(self._own(ref)) or self.path is None:
            return None
        loc = self._locations[ref.key]
        if isinstance(loc, ZipRecord) and loc.unresolved:  # a remote record: its header read at copy time
            crc = loc.crc if loc.size == ref.nbytes else None
            return FileRange(source_of(self._f), 0, ref.nbytes, crc, base=lambda: loc.data_offset)
        offset, size, crc = self._where(ref.key)
        return FileRange(source_of(self._f), offset, ref.nbytes, crc if size == ref.nbytes else None)

    def view_range(self, t: TensorRef) -> FileRange | None:
        """Where the bytes of a contiguous view lie in place in the file (CRC set when it covers its
        whole storage record), or None when they are not stored verbatim."""
        ref = t.storage
        if ref is None or not t.is_contiguous():
            return None
        whole = self.storage_range(ref)
        if whole is None:
            return None
        if t.covers_storage():
            return whole
        return FileRange(whole.fd, whole.offset + t.byte_offset, t.nbytes, base=whole.base)

    # -- reading -------------------------------------------------------------------------------
    def storage_bytes(self, ref: StorageRef) -> memoryview:
        """The bytes of one storage, in native byte order (the last one read is cached, for
        tensors that share it)."""
        self._own(ref)
        if self._cache is not None and self._cache[0] == ref.key:
            return self._cache[1]
        buf = bytearray(ref.nbytes)
        if ref.key in self._compressed:
            try:
                with zipfile.ZipFile(self._f) as zf, zf.open(self._compressed[ref.key]) as member:
                    view = memoryview(buf)
                    while len(view):
                        got = member.readinto(view)  # type: ignore[attr-defined]
                        if not got:
                            raise CorruptCheckpointError(f"{self.label}: storage {ref.key} is truncated")
                        view = view[got:]
            except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError, ValueError, zlib.error) as e:
                raise CorruptCheckpointError(f"{self.label}: cannot read storage {ref.key} ({e})") from e
        else:
            read_exact(self._f, self._where(ref.key)[0], memoryview(buf), self.label)
        if self._big_endian:
            buf = swap_bytes(buf, ref.dtype)
        out = memoryview(buf)
        self._cache = (ref.key, out)
        return out

    @property
    def file(self) -> IO[bytes]:
        return self._f

    def release(self) -> None:
        """Drop the cached storage (shared storages are cached while consecutive tensors use them)."""
        self._cache = None

    def close(self) -> None:
        self._cache = None
        self._f.close()

    def __enter__(self) -> TorchSaveFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Whole(contextlib.AbstractContextManager["_Whole"]):
    """An in-memory archive's bytes, where a file would be memory-mapped."""

    def __init__(self, f: IO[bytes]) -> None:
        f.seek(0)
        self._data = f.read()

    def __enter__(self) -> Any:
        return self._data

    def __exit__(self, *exc: object) -> None:
        self._data = b""


def archive_name(path: Path) -> str:
    """The top-level folder torch.save would use inside the archive for ``path``."""
    stem = path.name.rsplit(".", 1)[0] if "." in path.name[1:] else path.name
    return stem if stem and stem.isascii() and stem.isprintable() else "archive"


class TorchSaveWriter:
    """Streams a torch.save ZIP archive into ``f``: :meth:`write_pickle`, the storages, :meth:`finish`.

    Tensors in the pickled object are :class:`TensorRef` views of :class:`StorageRef` storages;
    each distinct storage gets a record key, in order of first use, and its bytes are supplied
    afterwards (:meth:`write_storage` from memory, :meth:`copy_storage` from another file). Views
    and shared storages are written as they are, like torch.save. Flushing and closing ``f`` is
    the caller's business.
    """

    def __init__(self, f: BinaryIO, archive: str = "archive") -> None:
        self._zip = ZipWriter(f, archive)

    def write_pickle(self, obj: Any) -> list[tuple[str, StorageRef]]:
        """Write ``data.pkl``; returns ``(key, storage)`` in key order, each storage once."""
        order: list[tuple[str, StorageRef]] = []
        keys: dict[int, str] = {}

        class _Pickler(TorchPickler):
            def persistent_id(self, o: Any) -> Any:
                if not isinstance(o, StorageRef):
                    return None
                key = keys.get(id(o))
                if key is None:
                    key = keys[id(o)] = str(len(keys))
                    order.append((key, o))
                return ("storage", o.storage_type, key, "cpu", o.numel)

        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        self._zip.write("data.pkl", buf.getbuffer())
        self._zip.write(".format_version", b"1")
        self._zip.write(".storage_alignment", b"64")
        self._zip.write("byteorder", sys.byteorder.encode())
        return order

    def write_storage(self, key: str, data: bytes | bytearray | memoryview, crc: int | None = None) -> None:
        """Append the record for ``key`` from its bytes."""
        self._zip.write(f"data/{key}", data, crc)

    def stream_storage(self, key: str, nbytes: int, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        """Append the record for ``key`` from its bytes as they come, piece by piece."""
        self._zip.write_stream(f"data/{key}", nbytes, pieces)

    def copy_storage(self, key: str, src: FileRange, label: str) -> None:
        """Append the record for ``key`` by copying its bytes from another file in the kernel."""
        self._zip.copy(f"data/{key}", src, label)

    def finish(self) -> None:
        """Write the trailing records and the central directory."""
        self._zip.write("version", b"3\n")
        self._zip.write(".data/serialization_id", f"{int.from_bytes(os.urandom(16), 'little'):040d}".encode())
        self._zip.close()


def write_archive(obj: Any, archive: str = "archive") -> bytes:
    """A whole torch.save archive of ``obj`` in memory (DCP byte items); the bytes of its tensors'
    storages come from their archives."""
    from .._io import crc32

    buf = io.BytesIO()
    writer = TorchSaveWriter(buf, archive)
    for key, ref in writer.write_pickle(obj):
        if ref.archive is None:
            raise UnsupportedFormatError(f"a tensor in value {archive!r} has no data to write")
        data = ref.archive.storage_bytes(ref)
        writer.write_storage(key, data, crc32(data))
    writer.finish()
    return buf.getvalue()


def write_tensor_archive(
    f: BinaryIO,
    dtype: DType,
    shape: tuple[int, ...],
    data: FileRange | bytes | bytearray | memoryview | Iterator[bytes | bytearray | memoryview],
    *,
    crc: int | None = None,
    label: str = "",
    archive: str = "archive",
) -> None:
    """What ``torch.save(tensor, f)`` writes for a contiguous tensor -- the archive DCP stores for
    each tensor chunk -- with its bytes from memory (and their ``crc`` if known), copied from a
    :class:`FileRange`, or streamed from an iterator of pieces in row-major order (``f`` must then
    be seekable: the record's CRC is filled in after its bytes)."""
    numel = 1
    for s in shape:
        numel *= s
    writer = TorchSaveWriter(f, archive)
    storage = StorageRef.for_tensor("0", dtype, numel, None)
    ((key, _),) = writer.write_pickle(TensorRef.contiguous(storage, dtype, shape))
    if isinstance(data, FileRange):
        writer.copy_storage(key, data, label)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        writer.write_storage(key, data, crc)
    else:
        writer.stream_storage(key, storage.nbytes, data)
    writer.finish()
