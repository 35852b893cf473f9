"""torch.save files read lazily, without importing torch (written by :mod:`.writer`).

Reading (:class:`TorchSaveFile`): the pickle is loaded with weights-only semantics into an object
tree whose tensors are :class:`~dcpstudio.core.pickles.refs.TensorRef` descriptions; a storage's bytes
are read only when asked for, straight from its record. Opening a multi-GiB file therefore costs
about as much as reading its pickle. Both the ZIP format (torch >= 1.6) and the legacy sequential
format are read. :func:`dcpstudio.core.pickles.tensor_io.materialize` makes a torch tensor of a ref.

Writing (:class:`~.writer.TorchSaveWriter`): the pickle goes first, referencing storages by key,
then each storage's record is appended as its bytes become available, so a whole checkpoint never
needs to be in memory. Files load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import array
import io
import os
from pathlib import Path
from typing import IO, Any

from ...dtypes import DType
from ...errors import CorruptCheckpointError, MissingClassError, UnsafePickleError, UnsupportedFormatError
from ...io.files import open_regular
from ...io.raw import FileRange, read_exact, source_of
from ...io.remote.locations import RemotePath, as_location
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.tree import check_depth
from ...pickles.unpicklers import LazyStorages, load_torch_pickle
from .inflated import Inflated
from .legacy import read_legacy
from .zip import ZipDirectory, ZipRecord

__all__ = [
    "CHUNK_MEMBERS",
    "PICKLE_LIMIT",
    "VALUE_LIMIT",
    "TorchSaveFile",
    "swap_bytes",
]

PICKLE_LIMIT = 64 << 20  # a deflated data.pkl inflates to at most this (torch.save stores it as it is)
VALUE_LIMIT = 256 << 20  # all a compressed non-tensor value (an archive in memory) inflates to
_FIXED_MEMBERS = 32  # records besides the storages: data.pkl, version, byteorder, ... and some slack
CHUNK_MEMBERS = 1 + _FIXED_MEMBERS  # the most records a DCP tensor chunk's archive (one storage) may list

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
    held in memory (DCP stores each non-tensor value as one). Use as a context manager.

    Records other writers deflate are inflated in bounded blocks, each no further than its
    declared use allows: ``data.pkl`` to :data:`PICKLE_LIMIT`, a storage to the bytes its pickle
    declares; everything an archive in memory inflates, together, to ``inflate_limit``. A deflated
    storage of a file is inflated once into an unlinked temporary file, from which it is copied and
    read like a stored one, so memory never holds it whole unless a caller asks for its bytes."""

    def __init__(
        self,
        path: str | os.PathLike[str] | io.BytesIO,
        *,
        trust_pickle: bool = False,
        label: str = "",
        inflate_limit: int = VALUE_LIMIT,
    ) -> None:
        where = as_location(path) if not isinstance(path, io.BytesIO) else None
        self.path = where if where is None or isinstance(where, RemotePath) else Path(where)
        self._local = isinstance(self.path, Path)
        self.label = label or str(path)
        self.storages = LazyStorages(self)
        self._locations: dict[str, tuple[int, int, int | None] | ZipRecord] = {}  # offset, size, CRC
        self._compressed: dict[str, ZipRecord] = {}
        self._budget = inflate_limit if isinstance(path, io.BytesIO) else None  # None: no total bound
        self._inflated: Inflated | None = None
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
                self.obj, locations, self._big_endian = read_legacy(
                    self._f, self._local, self.label, self.storages, trust_pickle
                )
                self._locations.update(locations)
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
        """As torch reads it: the folder is the first entry's, ``data.pkl`` in it holds the pickle.
        Only the records the pickle references are built, once its directory is known to list no
        more entries than those and a few fixed ones (else a small file could list millions)."""
        directory = ZipDirectory(self._f, self.label)
        self._inflated = Inflated(directory.view, self.label, self._budget)
        prefix = directory.prefix
        if not prefix:
            raise CorruptCheckpointError(
                f"{self.label}: ZIP archive whose first record is in no folder (not torch.save)"
            )
        name = prefix + "data.pkl"
        pkl = directory.first if directory.first is not None and directory.first.name == name else None
        pkl = pkl or directory.find([name]).get(name)  # torch.save writes it first; a walk if not
        if pkl is None:
            raise CorruptCheckpointError(f"{self.label}: ZIP archive without a torch data.pkl; not a torch.save file")
        data = self._record_bytes(pkl, PICKLE_LIMIT)
        try:
            obj = load_torch_pickle(data, self.label, self.storages, trust=trust)
        except (UnsafePickleError, MissingClassError):
            if directory.find([prefix + "constants.pkl"]):  # what torch.jit.save writes beside its code/
                raise UnsupportedFormatError(
                    f"{self.label}: a TorchScript archive (torch.jit.save); DCP Studio reads state dicts -- "
                    "`torch.jit.load(...).state_dict()` gives one"
                ) from None
            raise
        del data
        refs = self.storages.refs
        if directory.count > len(refs) + _FIXED_MEMBERS:
            raise CorruptCheckpointError(
                f"{self.label}: its ZIP directory lists {directory.count} entries, but its pickle references only "
                f"{len(refs)} storages; not an archive torch.save writes"
            )
        records = directory.find([name, prefix + "byteorder", *(f"{prefix}data/{key}" for key in refs)])
        order = records.get(prefix + "byteorder")
        if order is not None:
            mark = self._record_bytes(order, 16)
            if mark not in (b"little", b"big"):
                raise CorruptCheckpointError(f"{self.label}: unknown byte order {mark[:16]!r} in its byteorder record")
            self._big_endian = mark == b"big"
        for key, ref in refs.items():
            rec = records.get(f"{prefix}data/{key}")
            if rec is None:
                raise CorruptCheckpointError(f"{self.label}: storage record data/{key} is missing")
            if rec.size < ref.nbytes or (not rec.stored and rec.size != ref.nbytes):
                raise CorruptCheckpointError(
                    f"{self.label}: storage record data/{key} holds {rec.size} bytes; its storage has {ref.nbytes}"
                )
            self._locations[key] = rec  # where its bytes start: known when first needed
            if not rec.stored:
                self._compressed[key] = rec
        return obj

    def _read_small(self, offset: int, size: int) -> bytes:
        buf = bytearray(size)
        read_exact(self._f, offset, memoryview(buf), self.label)
        return bytes(buf)

    def _record_bytes(self, rec: ZipRecord, limit: int) -> bytes:
        """A whole record (``data.pkl``, ``byteorder``): read as it is, or inflated to at most ``limit``."""
        if rec.stored:
            return self._read_small(rec.data_offset, rec.size)
        assert self._inflated is not None
        return self._inflated.record_bytes(rec, limit)

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

    def storage_file(self, ref: StorageRef) -> tuple[IO[bytes], int] | None:
        """The file a storage's bytes lie in as they are, and where they start: the archive for a
        stored record, the temporary file it is inflated into (now, if not yet) for a deflated
        one; None when they are byte-swapped or the archive is in memory."""
        if self._big_endian or self.path is None:
            return None
        rec = self._compressed.get(self._own(ref).key)
        if rec is None:
            return self._f, self._where(ref.key)[0]
        assert self._inflated is not None
        return self._inflated.spilled(rec, ref.nbytes)

    def storage_range(self, ref: StorageRef) -> FileRange | None:
        """The storage's bytes in the file (CRC set when the record holds exactly them); a deflated
        storage's in the temporary file it is inflated into."""
        if self.path is None or self._big_endian:
            return None
        rec = self._compressed.get(self._own(ref).key)
        if rec is not None:
            assert self._inflated is not None
            spill, start = self._inflated.spilled(rec, ref.nbytes)
            return FileRange(source_of(spill), start, ref.nbytes, rec.crc)
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
        rec = self._compressed.get(ref.key)
        where = self.storage_file(ref) if rec is None or self.path is not None else None
        if rec is not None and where is None:  # in memory, or to be byte-swapped: inflated into place
            assert self._inflated is not None
            buf = self._inflated.into_memory(rec, ref.nbytes)
        else:
            buf = bytearray(ref.nbytes)
            f, start = where if where is not None else (self._f, self._where(ref.key)[0])
            read_exact(f, start, memoryview(buf), self.label)
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
        if self._inflated is not None:
            self._inflated.close()
        self._f.close()

    def __enter__(self) -> TorchSaveFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
