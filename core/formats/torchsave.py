"""torch.save files, read lazily and written record by record.

Reading (:class:`TorchSaveFile`): the pickle is loaded with weights-only semantics into an object
tree whose tensors are *meta* tensors; a tensor's bytes are read only when :meth:`materialize` is
called, straight from its storage record. Opening a multi-GiB file therefore costs about as much
as reading its pickle. Both the ZIP format (torch >= 1.6) and the legacy sequential format are read.

Writing (:class:`TorchSaveWriter`): the pickle goes first, referencing storages by key, then each
storage's record is appended as its bytes become available, so a whole checkpoint never needs to
be in memory. Files load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import sys
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, BinaryIO

import torch

from .._io import FileRange, read_exact, swap_bytes, tensor_buffer
from .._pickle import LazyStorages, StorageRef, load_torch_pickle
from .._tree import iter_tensors
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ._zip import ZipWriter, read_zip_records

__all__ = ["TorchSaveFile", "TorchSaveWriter", "archive_name", "save_tensor"]

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class TorchSaveFile:
    """A torch.save file opened without reading tensor data. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str], *, trust_pickle: bool = False) -> None:
        self.path = Path(path)
        self.label = str(path)
        self.storages = LazyStorages()
        self._locations: dict[str, tuple[int, int, int | None]] = {}  # offset, size, CRC
        self._compressed: dict[str, str] = {}
        self._big_endian = False
        self._cache: tuple[str, torch.Tensor] | None = None
        try:
            self._f: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise UnsupportedFormatError(f"cannot open {self.label}: {e.strerror or e}") from e
        try:
            head = self._f.read(4)
            if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
                self.obj = self._open_zip(trust_pickle)
                self.format = "torch-zip"
            elif head[:1] == b"\x80":
                self.obj = self._open_legacy(trust_pickle)
                self.format = "torch-legacy"
            else:
                raise UnsupportedFormatError(f"{self.label}: not a torch.save file")
            for t in iter_tensors(self.obj):
                if t.layout != torch.strided or t.is_quantized:
                    kind = "quantized" if t.is_quantized else str(t.layout).removeprefix("torch.")
                    raise UnsupportedFormatError(
                        f"{self.label}: holds a {kind} tensor; only dense tensors are supported"
                    )
        except BaseException:
            self._f.close()
            raise

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
        obj = load_torch_pickle(io.BytesIO(data), self.label, self.storages, trust=trust)
        for key, ref in self.storages.refs.items():
            rec = records.get(f"{prefix}data/{key}")
            if rec is None:
                raise CorruptCheckpointError(f"{self.label}: storage record data/{key} is missing")
            if rec.size < ref.nbytes:
                raise CorruptCheckpointError(
                    f"{self.label}: storage record data/{key} holds {rec.size} bytes, needs {ref.nbytes}"
                )
            self._locations[key] = (rec.data_offset, rec.size, rec.crc)
            if not rec.stored:
                self._compressed[key] = rec.name
        return obj

    def _open_legacy(self, trust: bool) -> Any:
        self._f.seek(0)
        scratch = LazyStorages()
        magic = load_torch_pickle(self._f, self.label, scratch)
        if magic != _LEGACY_MAGIC:
            raise UnsupportedFormatError(f"{self.label}: a pickle, but not a torch.save file")
        if load_torch_pickle(self._f, self.label, scratch) != _LEGACY_PROTOCOL:
            raise UnsupportedFormatError(f"{self.label}: unsupported legacy torch.save protocol")
        sys_info = load_torch_pickle(self._f, self.label, scratch)
        if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
            self._big_endian = True
        obj = load_torch_pickle(self._f, self.label, self.storages, trust=trust)
        keys = load_torch_pickle(self._f, self.label, scratch)
        if not isinstance(keys, list):
            raise CorruptCheckpointError(f"{self.label}: damaged legacy storage list")
        pos = self._f.tell()
        size = os.fstat(self._f.fileno()).st_size
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

    # -- reading -------------------------------------------------------------------------------
    def location(self, ref: StorageRef) -> tuple[int, int]:
        """Byte offset and length of a storage's data in the file."""
        offset, size, _crc = self._locations[ref.key]
        return offset, size

    def source_range(self, t: torch.Tensor) -> FileRange | None:
        """The file bytes of ``t`` when they can be copied verbatim: ``t`` is a contiguous view of
        its whole storage, stored uncompressed in native byte order with a known CRC."""
        ref = self.storages.ref_of(t)
        if ref is None or ref.key in self._compressed or self._big_endian:
            return None
        offset, size, crc = self._locations[ref.key]
        nbytes = t.numel() * t.element_size()
        if crc is None or size != nbytes or ref.nbytes != nbytes or t.storage_offset() or not t.is_contiguous():
            return None
        return FileRange(self._f.fileno(), offset, nbytes, crc)

    def read_storage(self, ref: StorageRef) -> torch.Tensor:
        """The bytes of one storage as a uint8 tensor, in native byte order."""
        if self._cache is not None and self._cache[0] == ref.key:
            return self._cache[1]
        buf = torch.empty(ref.nbytes, dtype=torch.uint8)
        if ref.key in self._compressed:
            try:
                with zipfile.ZipFile(self._f) as zf, zf.open(self._compressed[ref.key]) as member:
                    view = tensor_buffer(buf)
                    while len(view):
                        got = member.readinto(view)  # type: ignore[attr-defined]
                        if not got:
                            raise CorruptCheckpointError(f"{self.label}: storage {ref.key} is truncated")
                        view = view[got:]
            except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError, ValueError, zlib.error) as e:
                raise CorruptCheckpointError(f"{self.label}: cannot read storage {ref.key} ({e})") from e
        else:
            read_exact(self._f, self._locations[ref.key][0], tensor_buffer(buf), self.label)
        if self._big_endian:
            buf = swap_bytes(buf, ref.dtype)
        self._cache = (ref.key, buf)
        return buf

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor with ``t``'s values; ``t`` must come from this file's object tree."""
        ref = self.storages.ref_of(t)
        if ref is None:
            return t
        buf = self.read_storage(ref)
        out = torch.empty(0, dtype=t.dtype)
        return out.set_(buf.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    def view_range(self, view: torch.Tensor) -> FileRange | None:
        """Where the bytes of a contiguous view lie in place in the file (CRC set when the view
        covers its whole storage record), or None when they are not stored verbatim."""
        whole = self.source_range(view)
        if whole is not None:
            return whole
        ref = self.storages.ref_of(view)
        if ref is None or ref.key in self._compressed or self._big_endian or not view.is_contiguous():
            return None
        start = self._locations[ref.key][0] + int(view.storage_offset()) * view.element_size()
        return FileRange(self._f.fileno(), start, view.numel() * view.element_size())

    def read_contiguous(self, view: torch.Tensor) -> torch.Tensor | None:
        """The values of a contiguous view of one of this file's tensors, reading only its bytes;
        None when they are not in place (compressed record) or the view is not contiguous."""
        ref = self.storages.ref_of(view)
        if ref is None or ref.key in self._compressed or not view.is_contiguous():
            return None
        out = torch.empty(tuple(view.shape), dtype=view.dtype)
        if out.numel():
            start = self._locations[ref.key][0] + int(view.storage_offset()) * view.element_size()
            read_exact(self._f, start, tensor_buffer(out), self.label)
            if self._big_endian:
                raw = swap_bytes(out.reshape(-1).view(torch.uint8), view.dtype)
                out = raw.view(view.dtype).reshape(out.shape)
        return out

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


class _StorageMarker:
    """Stands for a storage whose bytes are written later (the pickle only needs its key)."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


@functools.cache
def _legacy_storage_type(dtype: torch.dtype) -> Any | None:
    probe = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(0), dtype=dtype, _internal=True)
    try:
        return getattr(torch, probe._pickle_storage_type())
    except KeyError:
        return None


def archive_name(path: Path) -> str:
    """The top-level folder torch.save would use inside the archive for ``path``."""
    stem = path.name.rsplit(".", 1)[0] if "." in path.name[1:] else path.name
    return stem if stem and stem.isascii() and stem.isprintable() else "archive"


class TorchSaveWriter:
    """Streams a torch.save ZIP archive into ``f``: :meth:`write_pickle`, the storages, :meth:`finish`.

    Tensors in the pickled object may be *placeholders* (meta tensors registered in
    ``placeholders``) whose bytes are supplied later through :meth:`write_storage`, or ordinary CPU
    tensors, whose storages are written by :meth:`write_pending_real_storages`. Flushing and closing
    ``f`` is the caller's business (:func:`save_tensor` and the converters do it).
    """

    def __init__(self, f: BinaryIO, archive: str = "archive") -> None:
        self._zip = ZipWriter(f, archive)
        self._real: dict[str, torch.UntypedStorage] = {}

    def write_pickle(self, obj: Any, placeholders: dict[int, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Write ``data.pkl``; returns ``(key, placeholder)`` in key order, each key once."""
        order: list[tuple[str, torch.Tensor]] = []
        keys: dict[tuple[str, int], str] = {}
        real = self._real

        class _Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> Any:
                if isinstance(o, _StorageMarker):
                    st = _legacy_storage_type(o.dtype)
                    if st is None:
                        nbytes = o.numel * o.dtype.itemsize
                        return ("storage", torch.UntypedStorage, o.key, "cpu", nbytes)
                    return ("storage", st, o.key, "cpu", o.numel)
                if isinstance(o, torch.storage.TypedStorage):
                    key = keys.setdefault(("s", o._untyped_storage._cdata), str(len(keys)))
                    real[key] = o._untyped_storage
                    return ("storage", getattr(torch, o._pickle_storage_type()), key, "cpu", o._size())
                if isinstance(o, torch.UntypedStorage):
                    key = keys.setdefault(("s", o._cdata), str(len(keys)))
                    real[key] = o
                    return ("storage", torch.UntypedStorage, key, "cpu", o.nbytes())
                return None

            def reducer_override(self, o: Any) -> Any:
                if not (isinstance(o, torch.Tensor) and id(o) in placeholders):
                    return NotImplemented
                key = keys.get(("p", id(o)))
                if key is None:
                    key = keys.setdefault(("p", id(o)), str(len(keys)))
                    order.append((key, o))
                marker = _StorageMarker(key, o.dtype, o.numel())
                args: tuple[Any, ...] = (marker, 0, tuple(o.size()), o.stride(), False, OrderedDict())
                if _legacy_storage_type(o.dtype) is None:
                    return (torch._utils._rebuild_tensor_v3, (*args, o.dtype))
                return (torch._utils._rebuild_tensor_v2, args)

        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        self._zip.write("data.pkl", buf.getbuffer())
        self._zip.write(".format_version", b"1")
        self._zip.write(".storage_alignment", b"64")
        self._zip.write("byteorder", sys.byteorder.encode())
        return order

    def write_storage(self, key: str, tensor: torch.Tensor, crc: int | None = None) -> None:
        """Append the record for ``key`` from a contiguous CPU tensor holding its bytes."""
        self._zip.write(f"data/{key}", tensor_buffer(tensor), crc)

    def copy_storage(self, key: str, src: FileRange, label: str) -> None:
        """Append the record for ``key`` by copying its bytes from another file in the kernel."""
        self._zip.copy(f"data/{key}", src, label)

    def write_pending_real_storages(self) -> None:
        """Write the storages of ordinary tensors met while pickling (non-placeholders)."""
        for key, storage in self._real.items():
            data = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._zip.write(f"data/{key}", tensor_buffer(data))
        self._real.clear()

    def finish(self) -> None:
        """Write the trailing records and the central directory."""
        self._zip.write("version", b"3\n")
        self._zip.write(".data/serialization_id", f"{int.from_bytes(os.urandom(16), 'little'):040d}".encode())
        self._zip.close()


def save_tensor(
    f: BinaryIO,
    like: torch.Tensor,
    data: torch.Tensor | FileRange,
    *,
    crc: int | None = None,
    label: str = "",
) -> None:
    """What ``torch.save(tensor, f)`` writes for a contiguous tensor shaped like ``like`` -- the
    archive DCP stores for each tensor chunk -- with its bytes from a contiguous CPU tensor (and
    its ``crc`` if known) or copied from a :class:`FileRange`."""
    writer = TorchSaveWriter(f)
    placeholder = torch.empty(like.size(), dtype=like.dtype, device="meta")
    ((key, _),) = writer.write_pickle(placeholder, {id(placeholder): placeholder})
    if isinstance(data, FileRange):
        writer.copy_storage(key, data, label)
    else:
        writer.write_storage(key, data, crc)
    writer.finish()
