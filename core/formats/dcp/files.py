"""DCP directories without torch: their metadata, their chunks, and a streaming writer.

A DCP checkpoint is a directory of ``__R_F.distcp`` data files -- one small torch.save archive per
tensor chunk or non-tensor value -- and a pickled ``Metadata`` in ``.metadata``. Reading:
:func:`read_light_metadata` unpickles ``.metadata`` into light records (restricted: DCP's metadata
classes only); :func:`open_chunk` parses one chunk's archive to find where its raw bytes lie.
Writing: :func:`write_dcp` produces what ``torch.distributed.checkpoint.save`` does for one
process (``__0_0.distcp`` and ``.metadata``), loadable by ``dcp.load`` and torch's
``dcp_to_torch_save``, copying tensor bytes in the kernel where they lie in place.

torch's own ``StorageReader``/``StorageWriter`` subclasses, for ``dcp.load``/``dcp.save``, are in
:mod:`dcpstudio.core.formats.dcp.storage`.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

from ...dtypes import dtype_of
from ...errors import CorruptCheckpointError, UnsupportedFormatError
from ...io.files import abandon, create_file, member_path, read_regular, save_token, sync_file
from ...io.pipeline import prefetch
from ...io.raw import FileRange, Hole, read_exact
from ...pickles.refs import Size, StorageRef, TensorRef
from ...pickles.tensor_io import Payload
from ...pickles.unpicklers import (
    LIGHT_METADATA_GLOBALS,
    LazyStorages,
    TorchPickler,
    load_light_metadata,
    load_torch_pickle,
)
from ..manifest import MANIFEST_FILE, HashingFile, Manifest, TensorTap, tapped
from ..readback import ReadBack
from ..torchsave.archive import CHUNK_MEMBERS
from ..torchsave.writer import write_archive, write_tensor_archive
from ..torchsave.zip import FileView, read_zip_records
from .tiling import check_tiling

SelfWritten = Callable[[IO[bytes], Callable[[Hole], None]], int]  # writes a tensor's bytes, returns their CRC

__all__ = [
    "METADATA_FILE",
    "DCPItem",
    "check_tiling",
    "decode_item",
    "open_chunk",
    "read_light_metadata",
    "volume",
    "write_dcp",
    "write_metadata",
]

METADATA_FILE = ".metadata"
METADATA_LIMIT = 2 << 30  # a .metadata larger than this is refused before it is read
_ZSTD = "stream.zstd/1"


def read_light_metadata(path: Path, *, trust: bool = False) -> Any:
    """A DCP directory's ``.metadata`` as light records (no code from it runs unless ``trust``)."""
    md_path = path / METADATA_FILE
    if not md_path.exists():
        raise UnsupportedFormatError(f"{path}: no {METADATA_FILE} file; not a complete DCP checkpoint")
    data = read_regular(member_path(path, METADATA_FILE, "DCP metadata file"), METADATA_LIMIT, str(md_path))
    md = load_light_metadata(data, str(md_path), trust=trust)
    if not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{md_path}: does not hold DCP metadata")
    return md


def decode_item(descriptors: Sequence[str] | None, raw: bytes, label: str, limit: int) -> bytes:
    """Undo the stream transforms torch's writer applied to an item (zstd compression), producing
    at most ``limit`` bytes (the caller derives it from what the item declares: its chunk's bytes,
    or a value's limit); refused as soon as the output outgrows it.

    The stream is decompressed by one bounded read: zstandard fills a buffer of ``limit + 1``
    bytes as it goes, and the untouched part of it never becomes memory, so the result is held
    once (reading it in blocks and joining them would hold it twice)."""
    if not descriptors:
        return raw
    for descriptor in reversed(list(descriptors)):
        if descriptor != _ZSTD:
            raise UnsupportedFormatError(f"{label}: stored with the unknown transform {descriptor!r}")
        import zstandard

        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as reader:
                raw = reader.read(limit + 1)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"{label}: damaged zstd data ({e})") from e
        if len(raw) > limit:
            raise CorruptCheckpointError(f"{label}: decompresses to more than the {limit} bytes it can hold")
    return raw


def volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


@dataclass(frozen=True)
class Chunk:
    """One stored tensor chunk: its tensor (a :class:`TensorRef` over the archive's storage) and
    where that storage's bytes are."""

    tensor: TensorRef
    data_offset: int  # absolute offset of the storage bytes in the file
    stored: bool
    big_endian: bool
    record: str
    size: int  # bytes in the storage record
    crc: int | None  # from the archive's directory (None for safetensors data, which has none)

    def raw_offset(self) -> int | None:
        """Absolute offset of the tensor's row-major element bytes when they lie in place in the
        file (stored uncompressed, native byte order, contiguous); None otherwise."""
        t = self.tensor
        if not self.stored or self.big_endian or not t.is_contiguous():
            return None
        return self.data_offset + t.byte_offset

    def file_range(self, fd: Any, dtype: Any, shape: Sequence[int]) -> FileRange | None:
        """The tensor's bytes as a :class:`FileRange` when they lie in place and it has ``dtype``
        and ``shape``; the CRC is set only when the tensor covers its whole storage record."""
        t = self.tensor
        start = self.raw_offset()
        if start is None or t.dtype is not dtype_of(dtype) or tuple(t.shape) != tuple(shape):
            return None
        covers = t.storage_offset == 0 and self.size == t.nbytes
        return FileRange(fd, start, t.nbytes, self.crc if covers else None)


def open_chunk(f: IO[bytes], offset: int, length: int, label: str, fqn: str | None = None) -> Chunk:
    """Parse one stored tensor chunk of ``fqn``: the torch.save archive at ``[offset, offset+length)``
    of ``f`` or -- in a DCP saved with ``serialization_format=SAFETENSORS`` -- the safetensors data
    that starts at ``offset`` (the file's tensors, found by name)."""
    within = (offset, offset + length)  # a remote file reads ahead inside the chunk only
    head = bytearray(min(9, max(length, 9)))
    read_exact(f, offset, memoryview(head), label, within)
    if fqn is not None and head[:2] != b"PK" and head[8:9] == b"{":
        return _safetensors_chunk(f, offset, label, fqn)
    records = read_zip_records(f, label, offset, length, max_entries=CHUNK_MEMBERS)
    pickles = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CorruptCheckpointError(f"{label}: tensor chunk without a data.pkl")
    prefix = pickles[0][: -len("data.pkl")]
    pkl = records[pickles[0]]
    if not pkl.stored:
        raise UnsupportedFormatError(f"{label}: compressed tensor chunks are not supported")
    raw = bytearray(pkl.size)
    read_exact(f, offset + pkl.data_offset, memoryview(raw), label, within)
    storages = LazyStorages()
    tensor = load_torch_pickle(raw, label, storages)
    if not isinstance(tensor, TensorRef) or tensor.storage is None:
        raise CorruptCheckpointError(f"{label}: tensor chunk does not hold a tensor")
    rec = records.get(f"{prefix}data/{tensor.storage.key}")
    if rec is None or rec.size < tensor.storage.nbytes:
        raise CorruptCheckpointError(f"{label}: tensor chunk's data record is missing or short")
    order = records.get(prefix + "byteorder")
    big = False
    if order is not None:
        mark = bytearray(order.size)
        read_exact(f, offset + order.data_offset, memoryview(mark), label, within)
        big = bytes(mark) == b"big"
    return Chunk(tensor, offset + rec.data_offset, rec.stored, big, rec.name, rec.size, rec.crc)


def _safetensors_chunk(f: IO[bytes], offset: int, label: str, fqn: str) -> Chunk:
    from ..safetensors import parse_header

    tensors, _ = parse_header(f, Path(label), label, offset)
    found = next((t for t in tensors if t.name == fqn), None)
    if found is None:
        raise CorruptCheckpointError(f"{label}: the safetensors data at byte {offset} holds no tensor {fqn!r}")
    storage = StorageRef.for_tensor(fqn, found.dtype, found.nbytes // max(found.dtype.itemsize, 1), None)
    tensor = TensorRef.contiguous(storage, found.dtype, found.shape)
    return Chunk(tensor, found.data_offset, True, False, fqn, found.nbytes, None)


def chunk_view(f: IO[bytes], offset: int, length: int) -> FileView:
    return FileView(f, offset, length)


# -- writing ---------------------------------------------------------------------------------------
def split_files(
    items: Sequence[Any], sizes: Sequence[int], files: int | None, max_file_size: int | None
) -> list[list[Any]]:
    """Consecutive groups of ``items``: one, ``files`` of about equal total size, or each at most
    ``max_file_size`` (an item larger than that alone)."""
    if files is None and max_file_size is None:
        return [list(items)]
    limit = max_file_size if max_file_size is not None else -(-sum(sizes) // max(1, files or 1))
    groups: list[list[Any]] = [[]]
    size = 0
    for item, n in zip(items, sizes, strict=True):
        room = files is None or len(groups) < files
        if groups[-1] and size + n > limit and room and size > 0:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def _close_synced(f: Any, manifest: Manifest | None = None, back: Any = None) -> None:
    if f is not None:
        if back is not None:
            back.advance(back.files[-1], f)
        elif isinstance(f, HashingFile):
            assert manifest is not None
            manifest.files[Path(f.name).name] = {"size": f.tell(), "sha256": f.sha256()}
            f = f.raw
        sync_file(f)
        f.close()


@dataclass(frozen=True)
class DCPItem:
    """One entry of a DCP checkpoint to write: a tensor (stored as one whole chunk) or a value
    (stored as a torch.save archive; tensors inside are :class:`TensorRef`). ``path`` is the
    entry's place in the nested state dict (DCP's planner data): ``("model", "w")`` for
    ``model.w``."""

    fqn: str
    path: tuple[str | int, ...]
    tensor: TensorRef | None = None
    value: Any = None


_MD_MODULE = "torch.distributed.checkpoint.metadata"


def _record(name: str, module: str = _MD_MODULE, **fields: Any) -> Any:
    cls = LIGHT_METADATA_GLOBALS[(module, name)]
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """The light record of where an item's bytes lie (torch's ``_StorageInfo``)."""
    return _record(
        "_StorageInfo", "torch.distributed.checkpoint.filesystem", relative_path=relative_path, offset=offset,
        length=length,
    )  # fmt: skip


def write_dcp(
    directory: Path,
    items: Sequence[DCPItem],
    payload: Callable[[TensorRef], Payload | SelfWritten],
    *,
    checkpoint_id: str,
    on_item: Callable[[DCPItem], None],
    label: str,
    files: int | None = None,
    max_file_size: int | None = None,
    manifest: Manifest | None = None,
    reader: Callable[[], ReadBack] = ReadBack,
) -> None:
    """Write ``items`` as a DCP checkpoint into the new directory ``directory``: values first,
    then tensors (as torch's writer orders them), each tensor's bytes from ``payload(tensor)``,
    computed on a helper thread while the current one is written (a callable writes them: a cast).
    Calls ``on_item`` after each item (it may raise to cancel). Every file is fsynced. The items go
    to one data file, or in order over ``files`` data files of about equal size, or over as many as
    keep each under ``max_file_size`` (a larger tensor gets a file of its own: chunks stay whole).
    With ``manifest``, each tensor's digest and moments and each file's SHA-256 are recorded in it
    from the bytes written, and it is written as ``dcpstudio-manifest.json`` before ``.metadata``
    (values are not in it: their digests need torch). ``reader`` reads a local output back (a
    layout pass's stand-in knows the digests already)."""
    directory.mkdir()
    values = [i for i in items if i.tensor is None]
    tensors = [i for i in items if i.tensor is not None]
    order = [*values, *tensors]
    groups = split_files(order, [i.tensor.nbytes if i.tensor else 0 for i in order], files, max_file_size)
    file_of = {id(item): f"__0_{k}.distcp" for k, group in enumerate(groups) for item in group}
    storage_data: dict[Any, Any] = {}
    state_dict_metadata: dict[str, Any] = {}

    def produce(item: DCPItem) -> bytes | Payload | SelfWritten:
        if item.tensor is None:
            return write_archive(item.value)
        return payload(item.tensor)

    f: Any = None
    back = reader() if manifest is not None and isinstance(directory, Path) else None
    try:
        for item, data in prefetch(produce, order):
            file_name = file_of[id(item)]
            if f is None or f.name != str(directory / file_name):
                _close_synced(f, manifest, back)
                f = create_file(directory / file_name)
                if back is not None:
                    back.file(directory / file_name)
                elif manifest is not None:
                    f = HashingFile(f)
            offset = f.tell()
            t = item.tensor
            if t is None or isinstance(data, bytes):
                assert isinstance(data, bytes)
                f.write(data)
                index = _record("MetadataIndex", fqn=item.fqn, index=None)
            else:
                if callable(data):  # it writes its own bytes
                    at = write_tensor_archive(f, t.dtype, t.shape, partial(data, f))
                elif manifest is not None and back is None:
                    tap = TensorTap(t.dtype.name, tuple(t.shape))
                    crc = data.crc if isinstance(data, FileRange) else data[1]
                    body = data if isinstance(data, FileRange) else data[0]
                    write_tensor_archive(f, t.dtype, t.shape, tapped(body, tap, label), crc=crc)
                    manifest.tensors[item.fqn] = tap.record()
                elif isinstance(data, (FileRange, Hole)):
                    at = write_tensor_archive(f, t.dtype, t.shape, data, label=f"{label} ({item.fqn})")
                else:
                    at = write_tensor_archive(f, t.dtype, t.shape, data[0], crc=data[1])
                if back is not None and manifest is not None:
                    back.tensor(back.files[-1], f, at, t.nbytes, t.dtype.name, tuple(t.shape), manifest.tensors,
                                item.fqn)  # fmt: skip
                index = _record("MetadataIndex", fqn=item.fqn, index=0, offset=Size((0,) * len(t.shape)))
            storage_data[index] = storage_info(file_name, offset, f.tell() - offset)
            on_item(item)
        _close_synced(f, manifest, back)
        f = None
        if back is not None and manifest is not None:
            back.wait()  # the files were fsynced while their bytes were hashed
            manifest.files.update(back.records())
    finally:
        if f is not None:
            abandon(f.raw if isinstance(f, HashingFile) else f)
        if back is not None:
            back.close()
    for item in items:
        t = item.tensor
        if t is None:
            state_dict_metadata[item.fqn] = _record("BytesStorageMetadata")
            continue
        props = _record("TensorProperties", dtype=t.dtype, requires_grad=False)
        chunk = _record("ChunkStorageMetadata", offsets=Size((0,) * len(t.shape)), sizes=Size(t.shape))
        state_dict_metadata[item.fqn] = _record(
            "TensorStorageMetadata", properties=props, size=Size(t.shape), chunks=[chunk]
        )
    write_metadata(
        directory, state_dict_metadata, {item.fqn: item.path for item in items}, storage_data, checkpoint_id, manifest
    )


def write_metadata(
    directory: Path,
    state_dict_metadata: dict[str, Any],
    planner_data: dict[str, tuple[str | int, ...]],
    storage_data: dict[Any, Any],
    checkpoint_id: str,
    manifest: Manifest | None = None,
) -> None:
    """Write the manifest (if any), then ``.metadata`` -- last: the checkpoint exists from then on --
    and fsync the directory."""
    metadata = _record(
        "Metadata",
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=_record(
            "StorageMeta",
            checkpoint_id=checkpoint_id,
            save_id=str(uuid.UUID(bytes=save_token(16), version=4)),
            load_id=None,
            modules=[],
        ),
        version="1.0.0",
    )
    buf = io.BytesIO()
    TorchPickler(buf, protocol=4).dump(metadata)
    if manifest is not None:
        manifest.files[METADATA_FILE] = {
            "size": len(buf.getbuffer()),
            "sha256": hashlib.sha256(buf.getbuffer()).hexdigest(),
        }
        with create_file(directory / MANIFEST_FILE) as f:
            f.write(manifest.dumps().encode())
            sync_file(f)
    with create_file(directory / METADATA_FILE) as f:  # last: the checkpoint exists from now on
        f.write(buf.getbuffer())
        sync_file(f)
    if isinstance(directory, Path):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
