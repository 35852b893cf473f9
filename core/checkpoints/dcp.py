"""DCP directories as a :class:`~.base.Checkpoint`: light metadata, validated storage index and
chunk sets, values read without torch where bytes lie in place (or as whole-row slabs)."""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .._buffers import new_tensor
from .._files import member_path, read_regular
from .._io import FileRange, read_box, read_exact
from .._pickle import gc_paused, load_light_metadata, load_light_metadata_head
from .._refs import StorageRef, TensorRef
from .._tensor_io import to_bytes
from ..dtypes import dtype_of
from ..errors import CorruptCheckpointError
from ..formats.dcp import METADATA_FILE, METADATA_LIMIT, check_tiling, decode_item, open_chunk, volume
from ..formats.detect import Format
from ..formats.torchsave import TorchSaveFile
from ..model import Chunk, Entry, Node, build_tree
from .base import Checkpoint, Region, _box, _OpenFiles, _overlaps, _place, _read, _row_slabs

__all__ = ["DCPCheckpoint"]

_HEAD_ONLY_ABOVE = 4 << 20  # .metadata sizes past which the storage index is parsed lazily
_VALUE_LIMIT = 1 << 30  # a non-tensor value never decompresses to more than this


def _damaged_metadata(method: Any) -> Any:
    """Light metadata records hold whatever the pickle put in them: a missing or mistyped field
    means a damaged ``.metadata``, reported as such."""

    @functools.wraps(method)
    def wrapper(self: DCPCheckpoint, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (AttributeError, TypeError, IndexError) as e:
            raise CorruptCheckpointError(
                f"{self.path / METADATA_FILE}: damaged metadata ({type(e).__name__}: {e})"
            ) from e

    return wrapper


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        raise TypeError(f"expected a short tuple of integers, got {type(value).__name__}")
    out = tuple(value)
    if not all(type(v) is int and v >= 0 for v in out):
        raise TypeError("expected non-negative integers")
    return out


def _same_metadata(head: Any, full: Any) -> bool:
    """Whether the whole ``.metadata`` describes the same entries (names, kinds, dtypes, shapes,
    chunks) and nesting as its head did."""
    a, b = head.state_dict_metadata, getattr(full, "state_dict_metadata", None)
    if not isinstance(b, dict) or list(a) != list(b) or head.planner_data != getattr(full, "planner_data", None):
        return False
    for fqn, x in a.items():
        y = b[fqn]
        if type(x) is not type(y):
            return False
        if hasattr(x, "chunks") and (
            x.properties.dtype is not y.properties.dtype
            or tuple(x.size) != tuple(y.size)
            or [(tuple(c.offsets), tuple(c.sizes)) for c in x.chunks]
            != [(tuple(c.offsets), tuple(c.sizes)) for c in y.chunks]
        ):
            return False
    return True


@dataclass(frozen=True)
class _Stored:
    """Where one DCP item (a tensor chunk's archive or a value's) lies: validated storage info."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


def _stored(info: Any) -> _Stored:
    file, offset, length = info.relative_path, info.offset, info.length
    transforms = getattr(info, "transform_descriptors", None) or ()
    if not isinstance(file, str) or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise TypeError("storage info needs a file name and non-negative offset and length")
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise TypeError("storage info has invalid transform descriptors")
    return _Stored(file, offset, length, tuple(transforms))


class DCPCheckpoint(Checkpoint):
    format: Format = "dcp"

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        md_path = path / METADATA_FILE
        data = read_regular(member_path(path, METADATA_FILE, "DCP metadata file"), METADATA_LIMIT, str(md_path))
        label = str(md_path)
        md: Any = None
        if len(data) > _HEAD_ONLY_ABOVE and not trust_pickle:
            md = load_light_metadata_head(data, label)  # storage index parsed on first use
        self._head_only = md is not None
        if md is None:
            md = load_light_metadata(data, label, trust=trust_pickle)
        sdm = getattr(md, "state_dict_metadata", None)
        if not isinstance(sdm, dict):
            raise CorruptCheckpointError(f"{md_path}: does not hold DCP metadata")
        self._data = data
        entries: dict[str, Entry] = {}
        try:
            with gc_paused():
                for fqn, smd in sdm.items():
                    if not isinstance(fqn, str):
                        raise TypeError(f"entry name {fqn!r} is not a string")
                    if hasattr(smd, "chunks"):
                        entries[fqn] = Entry(fqn, "tensor", dtype_of(smd.properties.dtype), _ints(smd.size))
                    else:
                        entries[fqn] = Entry(fqn, "bytes")
        except (AttributeError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{md_path}: damaged metadata entry ({e})") from e
        super().__init__(path, entries, {"version": getattr(md, "version", None)})
        self._md = md
        self._trust = trust_pickle
        self._index: dict[str, dict[tuple[int, ...], _Stored]] | None = None
        self._chunks: dict[str, list[Chunk]] = {}
        self._raw: dict[tuple[str, tuple[int, ...]], int | None] = {}  # parsed once per chunk
        self._files = _OpenFiles(path, "DCP data file")

    @_damaged_metadata
    def _storage(self) -> dict[str, dict[tuple[int, ...], _Stored]]:
        """fqn -> chunk offsets -> storage info, built on first use. A large ``.metadata`` is
        opened without its storage index; this parses the whole pickle then (100k tensors: ~1.5 s)."""
        if self._index is None:
            if self._head_only:  # the whole pickle, now: it must say what its head said
                full = load_light_metadata(self._data, str(self.path / METADATA_FILE))
                if not _same_metadata(self._md, full):
                    raise CorruptCheckpointError(
                        f"{self.path / METADATA_FILE}: its entries are set twice, differently; refusing an ambiguous "
                        "checkpoint"
                    )
                self._md, self._head_only = full, False
            storage_data = getattr(self._md, "storage_data", None)
            if not isinstance(storage_data, dict):
                raise CorruptCheckpointError(f"{self.path / METADATA_FILE}: has no storage index")
            self._data = b""
            index: dict[str, dict[tuple[int, ...], _Stored]] = {}
            for key, info in storage_data.items():
                fqn, offset = key.fqn, getattr(key, "offset", None)  # no offset for byte items
                if not isinstance(fqn, str):
                    raise TypeError("a storage key without a name")
                index.setdefault(fqn, {})[_ints(offset) if offset is not None else ()] = _stored(info)
            for fqn, entry in self.entries.items():
                if entry.kind == "bytes":
                    stored = index.get(fqn, {}).get(())
                    entry.byte_size = stored.length if stored is not None else 0
            self._index = index
        return self._index

    @functools.cached_property
    def tree(self) -> Node:
        self._storage()  # byte items' sizes count in the totals
        return build_tree(self.entries, self.path.name)

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        data = getattr(self._md, "planner_data", None)
        out = super().paths()
        if isinstance(data, dict):
            for fqn in self.entries:
                path = data.get(fqn)
                if isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path):
                    out[fqn] = path
        return out

    def _descriptors(self, fqn: str, offsets: tuple[int, ...]) -> list[str] | None:
        """Stream transforms (e.g. zstd) applied to a stored item, None when it is stored plain."""
        return list(self._info(fqn, offsets).transforms) or None

    def _info(self, fqn: str, offsets: tuple[int, ...]) -> _Stored:
        info = self._storage().get(fqn, {}).get(offsets)
        if info is None:
            raise CorruptCheckpointError(f"{self.path}: no storage entry for {fqn!r} at {list(offsets)}")
        return info

    def chunk_count(self, fqn: str) -> int:
        """From the metadata's chunk list alone: no storage index needed (it may not be parsed yet)."""
        if self.entry(fqn).kind != "tensor":
            return 1
        listed = getattr(self._md.state_dict_metadata.get(fqn), "chunks", None)
        return len(listed) if isinstance(listed, (list, tuple)) else len(self.chunks(fqn))

    @_damaged_metadata
    def chunks(self, fqn: str) -> list[Chunk]:
        """The tensor's chunks, checked to tile it exactly (a value's one stored item)."""
        found = self._chunks.get(fqn)
        if found is not None:
            return found
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            info = self._info(fqn, ())
            return [Chunk((), (), info.file, info.offset, info.length)]
        listed = self._md.state_dict_metadata[fqn].chunks
        if not isinstance(listed, (list, tuple)):
            raise TypeError("chunks is not a list")
        out = []
        for c in listed:
            offsets, sizes = _ints(c.offsets), _ints(c.sizes)
            info = self._info(fqn, offsets)
            out.append(Chunk(offsets, sizes, info.file, info.offset, info.length))
        label = f"{self.path} ({fqn!r})"
        check_tiling(entry.shape or (), [(c.offsets, c.sizes) for c in out], label)
        assert entry.dtype is not None
        for c in out:  # a plain chunk's archive holds its bytes: it cannot be smaller than them
            if not self._info(fqn, c.offsets).transforms and volume(c.sizes) * entry.dtype.itemsize > (c.length or 0):
                raise CorruptCheckpointError(
                    f"{label}: the chunk at {list(c.offsets)} declares {list(c.sizes)} but stores only {c.length} bytes"
                )
        self._chunks[fqn] = out
        return out

    def _item_bytes(self, c: Chunk, fqn: str, limit: int) -> tuple[IO[bytes], int, int, str]:
        """Where a stored item's archive lies: in its data file, or (transformed) decoded in memory.
        Its byte range must lie inside the file."""
        label = f"{self.path / (c.file or '')} ({fqn!r})"
        offset, length = c.offset or 0, c.length or 0
        if offset + length > self._files.size(c.file or ""):
            raise CorruptCheckpointError(f"{label}: bytes {offset}-{offset + length} lie past the end of the file")
        f = self._files.get(c.file or "")
        descriptors = self._descriptors(fqn, c.offsets)
        if not descriptors:
            return f, offset, length, label
        raw = decode_item(descriptors, bytes(_read(f, offset, length, label)), label, limit)
        return io.BytesIO(raw), 0, len(raw), label

    def _raw_offset(self, fqn: str, c: Chunk) -> int | None:
        """Where a tensor chunk's row-major element bytes start in its data file, when they lie
        there as they are (not transformed, native byte order); parsed once per chunk."""
        key = (fqn, c.offsets)
        if key in self._raw:
            return self._raw[key]
        raw = None
        if c.file is not None and not self._descriptors(fqn, c.offsets):
            f, offset, length, label = self._item_bytes(c, fqn, 0)
            parsed = open_chunk(f, offset, length, label, fqn)
            _check_stored(parsed.tensor, self.entries[fqn], c, label)
            raw = parsed.raw_offset()
        self._raw[key] = raw
        return raw

    @_damaged_metadata
    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        if self.entries[fqn].kind != "tensor":
            return self.chunks(fqn)
        return [
            Chunk(c.offsets, c.sizes, c.file, c.offset, c.length, self._raw_offset(fqn, c)) for c in self.chunks(fqn)
        ]

    @_damaged_metadata
    def storage_range(self, ref: StorageRef) -> FileRange | None:
        fqn = ref.key
        entry = self.tensor_entry(fqn)
        chunks = self.chunks(fqn)
        if len(chunks) != 1 or any(chunks[0].offsets) or chunks[0].sizes != entry.shape:
            return None
        c = chunks[0]
        if self._descriptors(fqn, c.offsets):
            return None
        f, offset, length, label = self._item_bytes(c, fqn, 0)
        parsed = open_chunk(f, offset, length, label, fqn)
        _check_stored(parsed.tensor, entry, c, label)
        return parsed.file_range(f.fileno(), entry.dtype, entry.shape or ())

    @_damaged_metadata
    def storage_bytes(self, ref: StorageRef) -> memoryview:
        """The tensor's bytes: read in place, or assembled from chunks that are whole-row slabs
        (what FSDP writes) without torch; other layouts go through :meth:`read_tensor`."""
        fqn = ref.key
        entry = self.tensor_entry(fqn)
        assert entry.dtype is not None
        shape = entry.shape or ()
        chunks = _row_slabs(self.chunks(fqn), shape)
        if chunks is None:
            return to_bytes(self.read_tensor(fqn))
        row_bytes = entry.dtype.itemsize
        for s in shape[1:]:
            row_bytes *= s
        out = bytearray(entry.nbytes)
        view = memoryview(out)
        for c in chunks:
            f, offset, length, label = self._item_bytes(c, fqn, entry.nbytes + (1 << 20))
            parsed = open_chunk(f, offset, length, label, fqn)
            t, raw = parsed.tensor, parsed.raw_offset()
            _check_stored(t, entry, c, label)
            if raw is None:
                return to_bytes(self.read_tensor(fqn))
            start = (c.offsets[0] if c.offsets else 0) * row_bytes
            read_exact(f, raw, view[start : start + t.nbytes], label)
        return view

    def read_object(self, fqn: str) -> Any:
        entry = self.entry(fqn)
        if entry.kind == "tensor":
            return self.tensor_ref(fqn)
        (c,) = self.chunks(fqn)
        f, offset, length, label = self._item_bytes(c, fqn, _VALUE_LIMIT)
        raw = _read(f, offset, length, label)
        archive = TorchSaveFile(io.BytesIO(raw), trust_pickle=self._trust, label=label)
        return archive.obj

    @_damaged_metadata
    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        """The box's overlap with each chunk whose bytes lie in place is read alone (only about
        its bytes, however large the chunk); transformed chunks go through :class:`DCPReader`."""
        import torch

        entry = self.tensor_entry(fqn)
        assert entry.dtype is not None
        offsets, sizes = _box(entry, region)
        chunks = self.chunks(fqn)  # checked to tile the tensor, each within what its file stores
        if math.prod(sizes) == 0:
            return torch.empty(sizes, dtype=entry.dtype.torch)
        target: torch.Tensor | None = None  # every element is read below: the chunks tile it
        planned = []
        for k, local, size, at in _overlaps(offsets, sizes, [(c.offsets, c.sizes) for c in chunks]):
            c = chunks[k]
            raw = self._raw_offset(fqn, c)
            if raw is None:
                planned.append(c)
                continue
            label = f"{self.path / (c.file or '')} ({fqn!r})"
            piece = read_box(self._files.get(c.file or ""), raw, c.sizes, entry.dtype, local, size, label)
            if size == sizes:
                return piece  # one chunk holds the whole box
            target = new_tensor(sizes, entry.dtype.torch) if target is None else target
            _place(target, at, piece)
        target = new_tensor(sizes, entry.dtype.torch) if target is None else target
        if planned:
            self._read_planned(fqn, planned, offsets, sizes, target)
        return target

    def _read_planned(
        self, fqn: str, chunks: list[Chunk], offsets: list[int], sizes: list[int], target: torch.Tensor
    ) -> None:
        """Read the box's overlap with ``chunks`` into ``target`` through torch's read plan (which
        decodes each chunk whole: compressed chunks)."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        from ..formats.dcp_storage import DCPReader
        from ..planners import RegionPlanner

        entry = self.entries[fqn]
        md = TensorStorageMetadata(
            TensorProperties(dtype=target.dtype),
            torch.Size(entry.shape or ()),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks],
        )
        reader = DCPReader(self.path, trust_pickle=self._trust)
        reader.storage_data = {
            MetadataIndex(fqn, torch.Size(c.offsets)): SimpleNamespace(  # what DCPReader reads of an info
                relative_path=c.file or "",
                offset=c.offset or 0,
                length=c.length or 0,
                transform_descriptors=self._descriptors(fqn, c.offsets),
            )
            for c in chunks
        }
        box = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        items = create_read_items_for_chunk_list(fqn, md, [box])
        reader.read_data(LoadPlan(items), RegionPlanner(target)).wait()

    def close(self) -> None:
        self._files.close()


def _check_stored(t: TensorRef, entry: Entry, c: Chunk, label: str) -> None:
    """A stored chunk holds what the metadata says it holds."""
    if t.dtype is not entry.dtype or t.shape != c.sizes:
        raise CorruptCheckpointError(
            f"{label}: the chunk stores {t.dtype} {list(t.shape)}; the metadata says {entry.dtype} {list(c.sizes)}"
        )
