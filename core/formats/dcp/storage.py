"""torch's own storage layer for DCP directories, made safe and fast: use these with
``torch.distributed.checkpoint.load`` / ``save``.

:class:`DCPReader` and :class:`DCPWriter` (:mod:`.writer`) subclass torch's
``FileSystemReader`` / ``FileSystemWriter`` and keep their on-disk format. What the reader changes:

* the ``.metadata`` pickle is read with an allow-list of DCP's metadata classes (no code from the
  file runs) with the cyclic GC paused, which is also several times faster;
* a tensor chunk is read by parsing its small archive and reading the requested bytes straight
  into the destination tensor -- no ``torch.load`` of the chunk, no intermediate copy -- and only
  the byte range a request needs when the chunk is contiguous;
* a request is found in the stored chunks by where it lies in the tensor, so any planner's cut
  (torch's ``DynamicMetaLoadPlanner`` plans against each rank's own shards) reads the right bytes.

This module imports torch; :mod:`dcpstudio.core.formats.dcp.files` reads and writes the same format
without it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ...errors import CorruptCheckpointError, DCPStudioError, UnsafePickleError, UnsupportedFormatError
from ...io.files import file_size, member_path, open_member, read_regular
from ...io.raw import contiguous_span, read_exact, swap_bytes, tensor_buffer
from ...io.remote.locations import as_location, is_url
from ...pickles.plan_records import PLANNER_CLASSES, WriteItemKind
from ...pickles.stand_ins import get_layout
from ...pickles.unpicklers import DCP_METADATA_CLASSES, LIGHT_METADATA_GLOBALS, PLAIN_GLOBALS, _load, _unsafe_metadata
from ..torchsave.archive import VALUE_LIMIT
from .files import METADATA_FILE, METADATA_LIMIT, check_tiling, decode_item, open_chunk
from .transforms import undo_transforms
from .writer import DCPWriter, storage_info

__all__ = ["DCPReader", "DCPWriter", "read_metadata", "storage_info", "unwrap_error"]

_Piece = tuple[MetadataIndex, tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # chunk, at, lengths, into


def unwrap_error(error: BaseException) -> BaseException:
    """DCP wraps every exception raised by a planner or storage layer in a
    ``CheckpointException``; give back the original."""
    for failure in getattr(error, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) and failure else getattr(failure, "exc", None)
        if isinstance(inner, BaseException):
            return inner
    return error


def _metadata_globals() -> dict[tuple[str, str], Any]:
    import importlib

    found: dict[tuple[str, str], Any] = dict(PLAIN_GLOBALS)
    for module, name in DCP_METADATA_CLASSES:
        try:
            found[(module, name)] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue  # e.g. _hf_utils on older torch
    found.update({key: LIGHT_METADATA_GLOBALS[key] for key in (*PLANNER_CLASSES, WriteItemKind.torch_global)})
    found[("torch", "Size")] = torch.Size
    found[("torch.serialization", "_get_layout")] = lambda name: getattr(torch, str(get_layout(name)).split(".", 1)[1])
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            found[("torch", name)] = getattr(torch, name)
    return found


def read_metadata(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> Metadata:
    """Load a DCP directory's ``.metadata`` as torch's ``Metadata`` without running code from it
    (unless trusted)."""
    md_path = as_location(path) / METADATA_FILE
    if not md_path.exists():
        raise UnsupportedFormatError(f"{path}: no {METADATA_FILE} file; not a complete DCP checkpoint")
    data = read_regular(
        member_path(as_location(path), METADATA_FILE, "DCP metadata file"), METADATA_LIMIT, str(md_path)
    )
    label = str(md_path)
    try:
        md = _load(data, label, "metadata pickle", _metadata_globals(), trust=trust_pickle)
    except UnsafePickleError as e:
        raise _unsafe_metadata(label)(e) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{md_path}: does not hold DCP metadata")
    if not isinstance(md.storage_data, dict):
        raise CorruptCheckpointError(f"{md_path}: has no storage index (saved by an unsupported writer)")
    return md


class DCPReader(FileSystemReader):
    """``FileSystemReader`` with safe metadata loading and zero-copy chunk reads.

    Usable with ``torch.distributed.checkpoint.load(..., storage_reader=DCPReader(path))``. Byte
    items are handed to the planner as usual; pair it with
    :class:`~dcpstudio.core.formats.dcp.planners.SafeLoadPlanner` so those are unpickled safely too.
    """

    def __init__(
        self, path: str | os.PathLike[str], _extension_registry: Any = None, *, trust_pickle: bool = False
    ) -> None:
        """``_extension_registry``: torch's ``ExtensionRegistry`` of the caller's stream transforms
        (as ``FileSystemReader`` takes it); without one, only the built-in zstd is undone."""
        super().__init__("." if is_url(path) else path)
        self.path: Any = as_location(path)  # torch's file system would turn "s3://b/x" into "s3:/b/x"
        self.trust_pickle = trust_pickle
        self.extension_registry = _extension_registry
        self.bytes_read = 0
        self._metadata = Metadata(state_dict_metadata={})
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}  # (fqn, offsets) -> sizes

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(None)
        if checkpoint_id is not None:
            self.path = as_location(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(self.path, trust_pickle=self.trust_pickle)
        for fqn, smd in md.state_dict_metadata.items():  # every element a load fills comes from a chunk
            if isinstance(smd, TensorStorageMetadata):
                boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks]
                check_tiling(tuple(smd.size), boxes, f"{self.path} ({fqn!r})")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each item's region is found in the stored chunks by ``storage_index.offset +
        storage_offsets``, so a planner whose metadata cuts the tensor otherwise than the checkpoint
        (torch's ``DynamicMetaLoadPlanner``: each rank's own shards) reads the right elements; a
        region may span several chunks. An item is committed once its last piece is read."""
        per_file: dict[str, list[tuple[int, int, _Piece]]] = {}
        left = [0] * len(plan.items)
        for k, item in enumerate(plan.items):
            byte_item: list[_Piece] = [(item.storage_index, (), (), ())]
            located = byte_item if item.type == LoadItemType.BYTE_IO else self._locate(item)
            left[k] = len(located)
            for piece in located:
                info = self._info(piece[0])
                per_file.setdefault(info.relative_path, []).append((info.offset, k, piece))
        targets: dict[int, torch.Tensor] = {}
        for k, n in enumerate(left):
            if n == 0:  # nothing stored to read: an empty region
                planner.commit_tensor(plan.items[k], self._target(plan.items[k], planner))
        for relative_path, pieces in per_file.items():
            path = self.path / relative_path
            with open_member(self.path, relative_path, "DCP data file") as f:
                for _, k, piece in sorted(pieces, key=lambda p: p[0]):
                    item = plan.items[k]
                    if item.type == LoadItemType.BYTE_IO:
                        self._read_item(cast(IO[bytes], f), path, item, piece, None, planner)
                        continue
                    target = targets.get(k)
                    if target is None:
                        target = targets[k] = self._target(item, planner)
                    self._read_item(cast(IO[bytes], f), path, item, piece, target, planner)
                    left[k] -= 1
                    if not left[k]:
                        planner.commit_tensor(item, targets.pop(k))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _locate(self, item: ReadItem) -> list[_Piece]:
        """The stored pieces of a tensor item's region: the chunk its ``storage_index`` names when
        that chunk holds the whole region (the usual case), else every chunk the region meets."""
        fqn = item.storage_index.fqn
        smd = self._metadata.state_dict_metadata.get(fqn)
        lengths = tuple(item.lengths)
        base = tuple(item.storage_index.offset or (0,) * len(lengths))
        start = tuple(b + o for b, o in zip(base, item.storage_offsets, strict=False))
        size = tuple(smd.size) if isinstance(smd, TensorStorageMetadata) else None
        if (
            size is None
            or not len(size) == len(base) == len(start) == len(lengths)
            or any(a < 0 or n < 0 or a + n > d for a, n, d in zip(start, lengths, size, strict=True))
        ):
            stored = f"a tensor of {list(size)}" if size is not None else "no tensor"
            raise DCPStudioError(
                f"{self.path}: the load asks for {fqn!r} {lengths and list(lengths)} at {list(start)}; "
                f"the checkpoint stores {stored} there"
            )
        if not all(lengths):
            return []
        own = self._chunks.get((fqn, base))
        local = tuple(a - b for a, b in zip(start, base, strict=True))
        if own is not None and all(o + n <= s for o, n, s in zip(local, lengths, own, strict=True)):
            return [(item.storage_index, local, lengths, (0,) * len(lengths))]
        assert isinstance(smd, TensorStorageMetadata)
        pieces: list[_Piece] = []
        for chunk in smd.chunks:
            lo = [max(a, c) for a, c in zip(start, chunk.offsets, strict=True)]
            hi = [min(a + n, c + s) for a, n, c, s in zip(start, lengths, chunk.offsets, chunk.sizes, strict=True)]
            if all(x < y for x, y in zip(lo, hi, strict=True)):
                at = tuple(x - c for x, c in zip(lo, chunk.offsets, strict=True))
                into = tuple(x - a for x, a in zip(lo, start, strict=True))
                n = tuple(y - x for x, y in zip(lo, hi, strict=True))
                pieces.append((MetadataIndex(fqn, chunk.offsets), at, n, into))
        return pieces

    def _target(self, item: ReadItem, planner: LoadPlanner) -> torch.Tensor:
        target = planner.resolve_tensor(item).detach()
        if list(target.size()) != list(item.lengths):
            raise CorruptCheckpointError(
                f"{self.path}: request {list(item.lengths)} for {item.storage_index.fqn!r} does not fit target "
                f"{list(target.size())}"
            )
        return target

    def _decoded_limit(self, index: MetadataIndex) -> int:
        """The most a compressed item may decompress to: its chunk's bytes (plus the archive around
        them) for a tensor, 256 MiB for a value."""
        smd = self._metadata.state_dict_metadata.get(index.fqn)
        sizes = self._chunks.get((index.fqn, tuple(index.offset or ())))
        if isinstance(smd, TensorStorageMetadata) and sizes is not None:
            n = smd.properties.dtype.itemsize
            for s in sizes:
                n *= s
            return n + (1 << 20)
        return VALUE_LIMIT

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        self._chunks = {
            (fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn, smd in metadata.state_dict_metadata.items()
            if isinstance(smd, TensorStorageMetadata)
            for c in smd.chunks
        }

    def _info(self, index: MetadataIndex) -> _StorageInfo:
        info = self.storage_data.get(index)
        if info is None:
            raise CorruptCheckpointError(f"{self.path}: metadata has no storage entry for {index.fqn}")
        return cast(_StorageInfo, info)

    def _read_item(
        self, f: IO[bytes], path: Path, item: ReadItem, piece: _Piece, target: torch.Tensor | None, planner: LoadPlanner
    ) -> None:
        """Read one piece: a byte item into the planner, or a region of a stored chunk (``piece``:
        the chunk, the region's offsets in it and lengths, and where it lands in ``target``)."""
        index, at, lengths, into = piece
        info = self._info(index)
        label = f"{path} ({index.fqn!r} at byte {info.offset})"
        source: IO[bytes] = f
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise CorruptCheckpointError(f"{label}: invalid storage range")
        if offset + length > file_size(f):
            raise CorruptCheckpointError(f"{label}: bytes {offset}-{offset + length} lie past the end of the file")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:
            raw = bytearray(length)
            read_exact(f, offset, memoryview(raw), label)
            limit = self._decoded_limit(index)
            if self.extension_registry is not None:
                decoded = undo_transforms(self.extension_registry, descriptors, bytes(raw), label, limit)
            else:
                decoded = decode_item(descriptors, bytes(raw), label, limit)
            source, offset, length = io.BytesIO(decoded), 0, len(decoded)
        if target is None:
            raw = bytearray(length)
            read_exact(source, offset, memoryview(raw), label)
            self.bytes_read += length
            planner.load_bytes(item, io.BytesIO(raw))
            return
        chunk = open_chunk(source, offset, length, label, index.fqn)
        dest = narrow_tensor_by_index(target, into, lengths)
        src = chunk.tensor
        if len(at) != len(src.shape) or any(o + n > s for o, n, s in zip(at, lengths, src.shape, strict=True)):
            raise CorruptCheckpointError(
                f"{label}: the stored chunk holds {list(src.shape)}; the metadata asks for {list(lengths)} "
                f"at {list(at)}"
            )
        smd = self._metadata.state_dict_metadata[index.fqn]
        assert isinstance(smd, TensorStorageMetadata)
        if src.dtype != smd.properties.dtype:
            raise CorruptCheckpointError(
                f"{label}: the stored chunk is {src.dtype}, the metadata says {smd.properties.dtype}"
            )
        span = None
        if (
            chunk.stored
            and not chunk.big_endian
            and src.is_contiguous()
            and dest.is_contiguous()
            and src.dtype == dest.dtype
            and dest.device.type == "cpu"
        ):
            span = contiguous_span(src.shape, at, lengths)
        if span is not None:
            start = chunk.data_offset + (src.storage_offset + span[0]) * src.dtype.itemsize
            read_exact(source, start, tensor_buffer(dest), label)
            self.bytes_read += dest.numel() * dest.element_size()
        else:
            assert src.storage is not None
            nbytes = src.storage.nbytes
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if chunk.stored:
                read_exact(source, chunk.data_offset, tensor_buffer(buf), label)
            else:
                raise UnsupportedFormatError(f"{label}: compressed tensor chunks are not supported")
            if chunk.big_endian:
                buf = swap_bytes(buf, src.dtype)
            self.bytes_read += nbytes
            full = torch.empty(0, dtype=src.dtype.torch).set_(
                buf.untyped_storage(), src.storage_offset, src.shape, src.stride
            )
            dest.copy_(narrow_tensor_by_index(full, at, lengths))
