"""Single files written with their manifest (:mod:`...formats.manifest`) inside: a safetensors file
(in its header's reserved room) and a torch.save file (a record of its own before the ZIP
directory). The bytes are copied in the kernel and read back from the page cache on worker threads
for each tensor's digest and moments and the file's SHA-256 (:class:`...formats.readback.ReadBack`)
-- no second pass over the source."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ...dtypes import DType
from ...formats.manifest import METADATA_KEY, ZIP_RECORD, Manifest
from ...formats.readback import ReadBack
from ...formats.safetensors import SafetensorsWriter
from ...formats.torchsave.writer import TorchSaveWriter
from ...io.direct import DirectWriter
from ...io.files import create_file, sync_file
from ...io.pipeline import prefetch
from ...io.raw import FileRange, Hole
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.tensor_io import Payload
from ...progress import Reporter
from .computed import CastReader, direct_writer, write_cast

__all__ = ["FileCasts", "write_safetensors_file", "write_torch_save_file"]


def write_safetensors_file(
    path: Path,
    shard: Sequence[tuple[str, TensorRef]],
    metadata: dict[str, str],
    produce: Callable[[tuple[str, TensorRef]], Payload | Hole | TensorRef],
    reporter: Reporter,
    label: str,
    *,
    manifest: bool = True,
    reader: Callable[[], ReadBack] = ReadBack,
) -> Manifest | None:
    """Write ``shard`` to ``path`` (with its manifest unless not ``manifest``); the source's
    ``metadata`` keys are kept and ours added beside (a stale manifest of ours in them is
    replaced). Returns the file's manifest -- None for a
    remote object: its header goes first and an upload cannot seek back to fill it in, and
    knowing the digests before the bytes would take a second pass (``hash --manifest`` writes one)."""
    specs = [(name, t.dtype, t.shape) for name, t in shard]
    kept = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    if manifest and isinstance(path, Path):
        reserve = Manifest.reserve([(n, d.name, tuple(s)) for n, d, s in specs], [path.name])
        return _write_read_back(path, shard, specs, kept, reserve, produce, reporter, label, reader)
    with create_file(path) as f, _Casts(path, f, reporter) as casts:
        writer = SafetensorsWriter(f, specs, kept)
        for (name, t), data in prefetch(produce, shard):
            if isinstance(data, TensorRef):
                casts.write(partial(writer.reserve, name), data)
            elif isinstance(data, Hole):  # laid out only: a distributed conversion's ranks write it
                writer.reserve(name, data)
            elif isinstance(data, FileRange):
                writer.copy(name, data, f"{label} ({name})")
            else:
                writer.write(name, data[0])
            reporter.advance(t.nbytes, current=name)
        writer.finish()
    return None


def _write_read_back(
    path: Path,
    shard: Sequence[tuple[str, TensorRef]],
    specs: list[tuple[str, DType, tuple[int, ...]]],
    metadata: dict[str, str],
    reserve: int,
    produce: Callable[[tuple[str, TensorRef]], Payload | Hole | TensorRef],
    reporter: Reporter,
    label: str,
    reader: Callable[[], ReadBack] = ReadBack,
) -> Manifest:
    """A local file: the bytes copied in the kernel and the manifest read back from the file
    (:class:`ReadBack`, or ``reader``'s stand-in when it is laid out with holes) while it is written
    and fsynced; then the header's room receives it."""
    part = Manifest()
    with create_file(path) as f, reader() as back, _Casts(path, f, reporter) as casts:
        writer = SafetensorsWriter(f, specs, metadata, reserve=reserve + 64)
        file = back.file(path, start=f.tell())
        for (name, t), data in prefetch(produce, shard):
            at = f.tell()
            if isinstance(data, TensorRef):
                casts.write(partial(writer.reserve, name), data)
            elif isinstance(data, Hole):  # laid out: ``reader`` knows the digests the ranks computed
                writer.reserve(name, data)
            elif isinstance(data, FileRange):
                writer.copy(name, data, f"{label} ({name})")
            else:
                writer.write(name, data[0])
            back.tensor(file, f, at, t.nbytes, t.dtype.name, tuple(t.shape), part.tensors, name)
            reporter.advance(t.nbytes, current=name)
        back.advance(file, f)
        sync_file(f)  # the data on its way to the disk while it is hashed
        back.wait()
        record = back.records()[path.name]
        part.files[path.name] = {"size": f.tell(), "data_offset": file.start, "data_sha256": record["sha256"]}
        writer.set_metadata(METADATA_KEY, part.dumps())
        writer.finish()
    return part


class _Casts:
    """A file's cast tensors, computed block by block and written past the page cache
    (:mod:`.computed`): one direct writer and one read buffer for all of them."""

    def __init__(self, path: Path | str, f: Any, reporter: Reporter) -> None:
        self._path, self._f, self._reporter = path, f, reporter
        self._writer: DirectWriter | None = None
        self._reader = CastReader()

    def write(self, reserve: Callable[[Hole], None], t: TensorRef, crc: bool = False) -> int:
        """``t`` written where ``reserve`` places its hole (the format's place for it, skipped);
        its CRC-32 with ``crc``."""
        hole = Hole(t.nbytes)
        reserve(hole)
        if self._writer is None:
            self._f.flush()
            self._writer = direct_writer(self._path, self._f.fileno())
        return write_cast(self._writer, self._reader, t, hole.placed[0][1], self._reporter.check, crc)

    def __enter__(self) -> _Casts:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()


class FileCasts:
    """The casts of a DCP's data files, each file's through one direct writer (:class:`_Casts`),
    closed -- its buffers freed -- when the next file begins and at the end."""

    def __init__(self, reporter: Reporter) -> None:
        self._reporter = reporter
        self._file: Any = None
        self._casts: _Casts | None = None

    def write(self, t: TensorRef, f: Any, reserve: Callable[[Hole], None]) -> int:
        if f is not self._file:
            self.close()
            self._file, self._casts = f, _Casts(str(f.name), f, self._reporter)
        assert self._casts is not None
        return self._casts.write(reserve, t, crc=True)

    def close(self) -> None:
        if self._casts is not None:
            self._casts.__exit__(None, None, None)
        self._file = self._casts = None

    def __enter__(self) -> FileCasts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_torch_save_file(
    f: Any,
    path: Path | None,
    archive: str,
    obj: Any,
    tensors: Sequence[tuple[str, TensorRef]],
    produce: Callable[[tuple[str, StorageRef]], Payload | Hole | TensorRef],
    reporter: Reporter,
    label: str,
    names: dict[int, str],
    reader: Callable[[], ReadBack] = ReadBack,
) -> Manifest | None:
    """Stream ``obj`` into ``f`` as a torch.save file: the pickle, then each storage's record. With
    ``path`` (a local file: it is read back), the entries of ``tensors`` that are contiguous runs of
    their storage get their digest and moments and the file its SHA-256 up to the manifest, which
    goes in a record of its own before the directory; other views are left to ``hash``. ``reader``:
    what reads the tensors and the file back (a layout pass's stand-in knows them already)."""
    writer = TorchSaveWriter(f, archive)
    order = writer.write_pickle(obj)
    by_storage: dict[int, list[tuple[str, TensorRef]]] = {}
    for fqn, t in tensors:
        if t.storage is not None and t.is_contiguous():
            by_storage.setdefault(id(t.storage), []).append((fqn, t))
    manifest = Manifest() if path is not None else None
    with reader() as back, _Casts(str(getattr(f, "name", "")), f, reporter) as casts:
        file = back.file(path) if path is not None else None
        for (key, ref), data in prefetch(produce, order):
            name = names.get(id(ref), key)
            if isinstance(data, TensorRef):  # a cast, computed by blocks (a local file only)
                writer.set_crc(key, casts.write(partial(writer.write_storage, key), data, crc=True))
            elif isinstance(data, Hole):  # laid out only: a distributed conversion's ranks write it
                writer.write_storage(key, data)
            elif isinstance(data, FileRange):
                writer.copy_storage(key, data, f"{label} ({name})")
            else:
                writer.write_storage(key, data[0], data[1])
            if file is not None and manifest is not None:
                at = writer.data_at(key)
                for fqn, t in by_storage.get(id(ref), ()):
                    where = at + t.storage_offset * t.dtype.itemsize
                    back.tensor(file, f, where, t.nbytes, t.dtype.name, tuple(t.shape), manifest.tensors, fqn)
            reporter.advance(ref.nbytes, current=name)
        if path is None or file is None or manifest is None:
            writer.finish()
            return None
        back.advance(file, f)
        sync_file(f)  # the data on its way to the disk while it is hashed
        back.wait()
        end = f.tell()
        manifest.files[path.name] = {
            "data_offset": 0,
            "data_end": end,
            "data_sha256": back.records()[path.name]["sha256"],
        }
    writer.write_record(ZIP_RECORD, manifest.dumps().encode())
    writer.finish()
    return manifest
