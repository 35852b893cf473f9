"""torch.save files written record by record, without torch: :class:`TorchSaveWriter` streams the
pickle (tensors as :class:`~...pickles.refs.TensorRef` views of storages) and then each storage's
record -- from memory, copied in the kernel, or streamed -- as torch.save lays them out; the small
archives DCP stores per tensor chunk (:func:`write_tensor_archive`) and per byte item
(:func:`write_archive`) are made the same way."""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from ...dtypes import DType
from ...errors import UnsupportedFormatError
from ...io.files import save_token
from ...io.raw import FileRange, Hole
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.unpicklers import TorchPickler
from .zip_writer import ZipWriter

__all__ = ["TorchSaveWriter", "archive_name", "write_archive", "write_tensor_archive"]


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

    def write_storage(self, key: str, data: bytes | bytearray | memoryview | Hole, crc: int | None = None) -> None:
        """Append the record for ``key`` from its bytes (a :class:`Hole`: left to another writer)."""
        if isinstance(data, Hole):
            return self._zip.reserve(f"data/{key}", data)
        self._zip.write(f"data/{key}", data, crc)

    def stream_storage(
        self, key: str, nbytes: int, pieces: Iterable[bytes | bytearray | memoryview], crc: int | None = None
    ) -> None:
        """Append the record for ``key`` from its bytes as they come, piece by piece (their
        ``crc`` when known, so nothing is written out of order)."""
        self._zip.write_stream(f"data/{key}", nbytes, pieces, crc)

    def set_crc(self, key: str, crc: int) -> None:
        """The CRC-32 of the record for ``key`` -- the last one -- once another writer wrote its bytes."""
        self._zip.set_crc(f"data/{key}", crc)

    def copy_storage(self, key: str, src: FileRange, label: str) -> None:
        """Append the record for ``key`` by copying its bytes from another file in the kernel."""
        self._zip.copy(f"data/{key}", src, label)

    def data_at(self, key: str) -> int:
        """Where the bytes of storage ``key``'s record start in the file."""
        return self._zip.data_at[f"data/{key}"]

    def write_record(self, name: str, data: bytes) -> None:
        """Append a record of our own (``.data/...``: torch's readers ignore records they do not ask for)."""
        self._zip.write(name, data)

    def finish(self) -> None:
        """Write the trailing records and the central directory."""
        self._zip.write("version", b"3\n")
        self._zip.write(".data/serialization_id", f"{int.from_bytes(save_token(16), 'little'):040d}".encode())
        self._zip.close()


def write_archive(obj: Any, archive: str = "archive") -> bytes:
    """A whole torch.save archive of ``obj`` in memory (DCP byte items); the bytes of its tensors'
    storages come from their archives."""
    from ...io.raw import crc32

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
    data: FileRange
    | Hole
    | bytes
    | bytearray
    | memoryview
    | Iterator[bytes | bytearray | memoryview]
    | Callable[[Callable[[Hole], None]], int],
    *,
    crc: int | None = None,
    label: str = "",
    archive: str = "archive",
) -> int:
    """What ``torch.save(tensor, f)`` writes for a contiguous tensor -- the archive DCP stores for
    each tensor chunk -- with its bytes from memory (and their ``crc`` if known), copied from a
    :class:`FileRange`, streamed from an iterator of pieces in row-major order (``f`` must then
    be seekable: the record's CRC is filled in after its bytes), or written by ``data`` itself:
    called with the function that reserves the record's bytes (a :class:`Hole`, placed in ``f``),
    it writes them there and returns their CRC-32. Returns where the bytes start."""
    numel = math.prod(shape)
    writer = TorchSaveWriter(f, archive)
    storage = StorageRef.for_tensor("0", dtype, numel, None)
    ((key, _),) = writer.write_pickle(TensorRef.contiguous(storage, dtype, shape))
    if isinstance(data, FileRange):
        writer.copy_storage(key, data, label)
    elif isinstance(data, (bytes, bytearray, memoryview, Hole)):
        writer.write_storage(key, data, crc)
    elif callable(data):
        writer.set_crc(key, data(partial(writer.write_storage, key)))
    else:
        writer.stream_storage(key, storage.nbytes, data, crc)
    writer.finish()
    return writer._zip.data_at[f"data/{key}"]
