"""Open any checkpoint as a :class:`Checkpoint` model and read single tensors or values from it.

Opening reads only structure, and imports no torch: DCP's ``.metadata`` (restricted, into light
records), torch.save's pickle (weights-only, tensors as :class:`~._refs.TensorRef` descriptions)
or safetensors headers. Tensor data is read on request, one tensor or one region at a time,
touching only the bytes that hold it; torch is imported when a torch tensor is made.

Every tensor entry is also available as a :class:`~._refs.TensorRef` (:meth:`Checkpoint.tensor_ref`)
whose storage knows where its bytes lie, so converters move bytes between formats without torch.
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any

from ._files import member_path, open_member, open_regular, read_regular
from ._io import FileRange, read_box, read_exact
from ._pickle import gc_paused, load_light_metadata, load_light_metadata_head
from ._refs import StorageRef, TensorRef
from ._tensor_io import materialize, to_bytes
from ._tree import flatten_state_dict, map_tensors
from .dtypes import dtype_of
from .errors import CorruptCheckpointError, UnsupportedFormatError
from .formats.dcp import METADATA_FILE, METADATA_LIMIT, check_tiling, decode_item, open_chunk, volume
from .formats.detect import TORCH_INDEX_SUFFIXES, Format, detect_format
from .formats.safetensors import SafetensorsTensor, read_safetensors_index
from .formats.torchsave import TorchSaveFile
from .formats.values import decode_values
from .model import Chunk, Entry, Node, Totals, build_tree, dtype_name, refuse_expanded, relative

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "Region", "open_checkpoint"]

Region = Sequence[slice]
ROOT_KEY = "<root>"
_HEAD_ONLY_ABOVE = 4 << 20  # .metadata sizes past which the storage index is parsed lazily
_VALUE_LIMIT = 1 << 30  # a non-tensor value never decompresses to more than this


def _box(entry: Entry, region: Region | None) -> tuple[list[int], list[int]]:
    shape = list(entry.shape or ())
    if region is None:
        return [0] * len(shape), shape
    if len(region) > len(shape):
        raise ValueError(f"{entry.fqn}: region has {len(region)} dimensions, the tensor {len(shape)}")
    offsets, sizes = [], []
    for dim, size in enumerate(shape):
        sl = region[dim] if dim < len(region) else slice(None)
        start, stop, step = sl.indices(size)
        if step != 1:
            raise ValueError(f"{entry.fqn}: regions take contiguous slices (step 1)")
        offsets.append(start)
        sizes.append(max(0, stop - start))
    return offsets, sizes


def _read(f: IO[bytes], offset: int, length: int, label: str) -> memoryview:
    buf = bytearray(length)
    read_exact(f, offset, memoryview(buf), label)
    return memoryview(buf)


class Checkpoint:
    """A checkpoint's structure, with methods to read its values one at a time.

    ``entries`` maps each flattened fully-qualified name to an :class:`Entry`. Use as a context
    manager (or call :meth:`close`) to release open files. A checkpoint is also the
    :class:`~._refs.StorageSource` of the tensor refs it hands out.
    """

    format: Format

    def __init__(self, path: Path, entries: dict[str, Entry], info: dict[str, Any] | None = None) -> None:
        self.path = path
        self.label = str(path)
        self.entries = entries
        self.info = info or {}

    # -- structure ------------------------------------------------------------------------------
    @functools.cached_property
    def tree(self) -> Node:
        return build_tree(self.entries, self.path.name)

    def totals_by_dtype(self) -> dict[str, Totals]:
        out: dict[str, Totals] = {}
        for e in self.entries.values():
            key = dtype_name(e.dtype) if e.kind == "tensor" else e.kind
            out.setdefault(key or "?", Totals()).add(e.nbytes)
        return dict(sorted(out.items(), key=lambda kv: -kv[1].nbytes))

    def totals_by_prefix(self) -> dict[str, Totals]:
        return {name: node.totals for name, node in self.tree.children.items()}

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.kind == "tensor")

    def entry(self, fqn: str) -> Entry:
        try:
            return self.entries[fqn]
        except KeyError:
            raise KeyError(f"{self.path}: no entry named {fqn!r}") from None

    def tensor_entry(self, fqn: str) -> Entry:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            raise ValueError(f"{fqn} is not a tensor")
        return entry

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        """Each entry's place in the nested state dict it came from (DCP's planner data):
        ``{"model.w": ("model", "w")}``; flat names map to themselves."""
        return {fqn: (fqn,) for fqn in self.entries}

    def chunks(self, fqn: str) -> list[Chunk]:
        """How a tensor is stored: its chunks, with file and byte range."""
        raise NotImplementedError

    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        """:meth:`chunks` with ``data_offset`` filled in (DCP parses each chunk's archive)."""
        return self.chunks(fqn)

    # -- values as descriptions (no torch) ------------------------------------------------------
    def tensor_ref(self, fqn: str) -> TensorRef:
        """The tensor as a :class:`TensorRef` whose storage this checkpoint can read or locate."""
        entry = self.tensor_entry(fqn)
        assert entry.dtype is not None
        shape = entry.shape or ()
        numel = 1
        for s in shape:
            numel *= s
        return TensorRef.contiguous(StorageRef.for_tensor(fqn, entry.dtype, numel, self), entry.dtype, shape)

    def storage_range(self, ref: StorageRef) -> FileRange | None:
        """Where the whole tensor named by ``ref`` lies verbatim in one file (CRC when known)."""
        return None

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        """The whole tensor named by ``ref``: its row-major bytes."""
        return to_bytes(self.read_tensor(ref.key))

    def read_object(self, fqn: str) -> Any:
        """A non-tensor value as stored; tensors inside it stay :class:`TensorRef` (no torch)."""
        raise NotImplementedError

    # -- values (torch) -----------------------------------------------------------------------------
    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        """One tensor, or the box ``region`` (a slice per leading dimension), read alone."""
        raise NotImplementedError

    def read_value(self, fqn: str) -> Any:
        """An entry's value with real torch tensors (a tensor entry, or a value holding tensors)."""
        if self.entry(fqn).kind == "tensor":
            return self.read_tensor(fqn)
        return map_tensors(self.read_object(fqn), materialize)

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _OpenFiles:
    """Data files of a checkpoint, opened once (reads use ``preadv``, so threads may share them)."""

    def __init__(self, root: Path, what: str) -> None:
        self._root = root
        self._what = what
        self._files: dict[str, IO[bytes]] = {}

    def get(self, name: str | Path) -> IO[bytes]:
        """A file the checkpoint names (which must lie inside it and be a regular file), or a path
        already checked so (an absolute :class:`Path`)."""
        key = str(name)
        f = self._files.get(key)
        if f is None:
            opened = open_regular(name) if isinstance(name, Path) else open_member(self._root, name, self._what)
            f = self._files[key] = opened
        return f

    def size(self, relative_path: str) -> int:
        return os.fstat(self.get(relative_path).fileno()).st_size

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


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

    @_damaged_metadata
    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        out = []
        for c in self.chunks(fqn):
            if self.entries[fqn].kind != "tensor" or c.file is None or self._descriptors(fqn, c.offsets):
                out.append(c)  # transformed (compressed): no raw bytes in place
                continue
            f, offset, length, label = self._item_bytes(c, fqn, 0)
            parsed = open_chunk(f, offset, length, label, fqn)
            _check_stored(parsed.tensor, self.entries[fqn], c, label)
            out.append(Chunk(c.offsets, c.sizes, c.file, c.offset, c.length, parsed.raw_offset()))
        return out

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
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        from .formats.dcp_storage import DCPReader
        from .planners import RegionPlanner

        entry = self.tensor_entry(fqn)
        assert entry.dtype is not None
        offsets, sizes = _box(entry, region)
        chunks = self.chunks(fqn)  # checked to tile the tensor, each within what its file stores
        dtype = entry.dtype.torch
        target = torch.empty(sizes, dtype=dtype)  # every element is read below: the chunks tile it
        if target.numel() == 0:
            return target
        md = TensorStorageMetadata(
            TensorProperties(dtype=dtype),
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
        return target

    def close(self) -> None:
        self._files.close()


def _check_stored(t: TensorRef, entry: Entry, c: Chunk, label: str) -> None:
    """A stored chunk holds what the metadata says it holds."""
    if t.dtype is not entry.dtype or t.shape != c.sizes:
        raise CorruptCheckpointError(
            f"{label}: the chunk stores {t.dtype} {list(t.shape)}; the metadata says {entry.dtype} {list(c.sizes)}"
        )


def _row_slabs(chunks: list[Chunk], shape: tuple[int, ...]) -> list[Chunk] | None:
    """The chunks in row order when they are whole-row slabs that tile the tensor exactly (each
    one a contiguous run of its bytes), else None."""
    if not shape:
        return chunks if len(chunks) == 1 and chunks[0].offsets == () else None
    ordered = sorted(chunks, key=lambda c: c.offsets)
    row = 0
    for c in ordered:
        if len(c.offsets) != len(shape) or c.offsets[0] != row or any(c.offsets[1:]) or c.sizes[1:] != shape[1:]:
            return None
        row += c.sizes[0]
    return ordered if row == shape[0] else None


class TorchCheckpoint(Checkpoint):
    """A torch.save file -- or a directory of them with an index (``pytorch_model.bin.index.json``,
    as transformers shards large models), whose flat state dicts are read as one."""

    format: Format = "torch"

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        index = torch_index(path)
        files = _index_files(index) if index is not None else [path]
        self._files: list[TorchSaveFile] = []
        self._file_of: dict[str, TorchSaveFile] = {}
        self._values: dict[str, Any] = {}
        self._paths: dict[str, tuple[str | int, ...]] = {}
        try:
            for file in files:
                self._add(file, trust_pickle, sharded=index is not None)
        except BaseException:
            self.close()
            raise
        entries: dict[str, Entry] = {}
        by_storage: dict[tuple[int, str], list[str]] = {}
        for fqn, value in self._values.items():
            if isinstance(value, TensorRef):
                key = value.storage.key if value.storage is not None else None
                entries[fqn] = Entry(
                    fqn,
                    "tensor",
                    value.dtype,
                    value.shape,
                    storage=key if index is None or key is None else f"{Path(self._file_of[fqn].label).name}/{key}",
                    storage_offset=value.storage_offset,
                    stride=value.stride,
                    stored=value.storage.nbytes if value.storage is not None else 0,
                )
                if key is not None:
                    by_storage.setdefault((id(self._file_of[fqn]), key), []).append(fqn)
            else:
                entries[fqn] = Entry(fqn, "object", value=value)
        for names in by_storage.values():
            if len(names) > 1:
                for name in names:
                    entries[name].shared_with = tuple(n for n in names if n != name)
        info = {"format": self._files[0].format if self._files else "torch-zip"}
        if index is not None:
            info["index"] = str(index)
        super().__init__(path, entries, info)

    def _add(self, file: Path, trust: bool, *, sharded: bool) -> None:
        tsf = TorchSaveFile(file, trust_pickle=trust)
        self._files.append(tsf)
        obj = tsf.obj
        if sharded and not isinstance(obj, dict):
            raise CorruptCheckpointError(f"{file}: a shard holds a {type(obj).__name__}, not a state dict")
        try:
            flat, paths = (
                flatten_state_dict(obj) if isinstance(obj, dict) else ({ROOT_KEY: obj}, {ROOT_KEY: (ROOT_KEY,)})
            )
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{file}: cannot flatten its names ({type(e).__name__}: {e})") from e
        for fqn, value in flat.items():
            if fqn in self._values:
                raise CorruptCheckpointError(f"{file}: {fqn!r} is also in {Path(self._file_of[fqn].label).name}")
            self._values[fqn] = value
            self._paths[fqn] = paths[fqn]
            self._file_of[fqn] = tsf

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        return dict(self._paths)

    @property
    def obj(self) -> Any:
        """The whole object a single file holds (tensors as :class:`TensorRef`); None for shards."""
        return self._files[0].obj if len(self._files) == 1 and "index" not in self.info else None

    def chunks(self, fqn: str) -> list[Chunk]:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            return []
        t = self._values[fqn]
        if t.storage is None:
            return []
        file = self._file_of[fqn]
        offset, size = file.location(t.storage)
        data = offset + t.byte_offset if t.is_contiguous() else None
        shape = entry.shape or ()
        return [Chunk((0,) * len(shape), shape, relative(Path(file.label), self.path), offset, size, data)]

    def tensor_ref(self, fqn: str) -> TensorRef:
        self.tensor_entry(fqn)
        ref: TensorRef = self._values[fqn]
        return ref

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        import torch

        from ._io import tensor_buffer

        entry = self.tensor_entry(fqn)
        offsets, sizes = _box(entry, region)
        t = self.tensor_ref(fqn).narrow(offsets, sizes)
        refuse_expanded(entry, self.label, "read", t.nbytes)
        file = self._file_of[fqn]
        where = file.view_range(t)
        if where is not None:  # contiguous and in place: read just its bytes, straight into the tensor
            out = torch.empty(t.shape, dtype=t.dtype.torch)
            if out.numel():
                read_exact(file.file, where.offset, tensor_buffer(out), file.label)
            return out
        full = materialize(t)
        file.release()
        return full.clone(memory_format=torch.contiguous_format)

    def read_object(self, fqn: str) -> Any:
        return self._values[self.entry(fqn).fqn]

    def read_value(self, fqn: str) -> Any:
        out = super().read_value(fqn)
        for file in self._files:
            file.release()
        return out

    def close(self) -> None:
        for file in self._files:
            file.close()


def torch_index(path: Path) -> Path | None:
    """The index of a directory of torch.save shards (``pytorch_model.bin.index.json``), if ``path``
    is one (or is the index itself)."""
    if path.is_file():
        return path if path.name.endswith(TORCH_INDEX_SUFFIXES) else None
    if not path.is_dir():
        return None
    found = sorted(p for p in path.iterdir() if p.name.endswith(TORCH_INDEX_SUFFIXES))
    return found[0] if found else None


def _index_files(index: Path) -> list[Path]:
    try:
        data = json.loads(read_regular(index, 100 << 20))
        names = sorted(set(data["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{index}: damaged index ({type(e).__name__}: {e})") from e
    return [member_path(index.parent, name, "shard named by the index") for name in names]


class SafetensorsCheckpoint(Checkpoint):
    """One safetensors file, a directory of shards, or torch's distributed HF layout -- each file
    holding each rank's shard of a tensor under its full name, placed by ``DCP_SHARDING_INFO`` --
    whose shards are assembled into full tensors. A lone shard file shows its tensors as shards."""

    format: Format = "safetensors"

    def __init__(self, path: Path) -> None:
        tensors, info = read_safetensors_index(path)
        parts: dict[str, list[SafetensorsTensor]] = {}
        for t in tensors:
            parts.setdefault(t.name, []).append(t)
        entries: dict[str, Entry] = {}
        for name, found in parts.items():
            entries[name] = self._entry(path, name, found)
        self._parts = parts
        for file_meta in info.get("metadata", {}).values():
            for fqn, value in decode_values(file_meta, str(path)).items():
                entries.setdefault(fqn, Entry(fqn, "object", value=value))
        super().__init__(path, entries, info)
        root = path if path.is_dir() else path.parent
        self._files = _OpenFiles(root, "safetensors shard")

    @staticmethod
    def _entry(path: Path, name: str, found: list[SafetensorsTensor]) -> Entry:
        dtype = found[0].dtype
        if any(t.dtype is not dtype for t in found):
            raise CorruptCheckpointError(f"{path}: the shards of {name!r} have different dtypes")
        if len(found) == 1 and not any(found[0].offsets):
            return Entry(name, "tensor", dtype, found[0].shape)
        ndim = len(found[0].shape)
        full = tuple(max(t.offsets[d] + t.shape[d] for t in found) for d in range(ndim))
        if len(found) == 1:  # one shard of a tensor whose other shards are elsewhere
            return Entry(name, "tensor", dtype, found[0].shape, shard_of=(found[0].offsets, full))
        check_tiling(full, [(t.offsets, t.shape) for t in found], f"{path} ({name!r})")
        return Entry(name, "tensor", dtype, full)

    def _local(self, fqn: str) -> list[SafetensorsTensor]:
        """The shards of a tensor, with offsets relative to the tensor as the entry shows it."""
        found = self._parts[self.entry(fqn).fqn]
        if self.entries[fqn].shard_of is not None:
            t = found[0]
            return [SafetensorsTensor(t.name, t.file, t.dtype, t.shape, t.data_offset, t.nbytes, (0,) * len(t.shape))]
        return found

    def chunks(self, fqn: str) -> list[Chunk]:
        return [
            Chunk(t.offsets, t.shape, relative(t.file, self.path), t.data_offset, t.nbytes, t.data_offset)
            for t in self._local(fqn)
        ]

    def _file(self, path: Path) -> IO[bytes]:
        return self._files.get(path)  # checked inside the checkpoint when the index was read

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        import torch

        entry = self.tensor_entry(fqn)
        offsets, sizes = _box(entry, region)
        parts = self._local(fqn)
        if len(parts) == 1:
            t = parts[0]
            return read_box(self._file(t.file), t.data_offset, t.shape, t.dtype, offsets, sizes, str(t.file))
        out = torch.empty(sizes, dtype=entry.dtype.torch if entry.dtype else None)  # the shards tile it
        for t in parts:  # each shard's overlap with the region
            lo = [max(o, s) for o, s in zip(offsets, t.offsets, strict=True)]
            hi = [min(o + n, s + m) for o, n, s, m in zip(offsets, sizes, t.offsets, t.shape, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            local = [a - s for a, s in zip(lo, t.offsets, strict=True)]
            size = [b - a for a, b in zip(lo, hi, strict=True)]
            piece = read_box(self._file(t.file), t.data_offset, t.shape, t.dtype, local, size, str(t.file))
            view = out
            for dim, (a, n) in enumerate(zip(lo, size, strict=True)):
                view = view.narrow(dim, a - offsets[dim], n)
            view.copy_(piece)
        return out

    def storage_range(self, ref: StorageRef) -> FileRange | None:
        parts = self._local(ref.key)
        if len(parts) != 1:
            return None
        t = parts[0]
        return FileRange(self._file(t.file).fileno(), t.data_offset, t.nbytes)

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        entry = self.tensor_entry(ref.key)
        parts = self._local(ref.key)
        if len(parts) == 1:
            t = parts[0]
            return _read(self._file(t.file), t.data_offset, t.nbytes, str(t.file))
        ordered = _row_slabs(self.chunks(ref.key), entry.shape or ())
        if ordered is None:
            return to_bytes(self.read_tensor(ref.key))
        out = bytearray(entry.nbytes)  # whole-row shards, in row order: their bytes one after another
        view = memoryview(out)
        pos = 0
        by_start = {t.offsets: t for t in parts}
        for c in ordered:
            t = by_start[c.offsets]
            read_exact(self._file(t.file), t.data_offset, view[pos : pos + t.nbytes], str(t.file))
            pos += t.nbytes
        return view

    def read_object(self, fqn: str) -> Any:
        entry = self.entry(fqn)
        return entry.value if entry.kind == "object" else self.tensor_ref(fqn)

    def close(self) -> None:
        self._files.close()


def open_checkpoint(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> Checkpoint:
    """Open a DCP directory, torch.save file or safetensors checkpoint without reading tensor data."""
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "dcp":
        return DCPCheckpoint(p, trust_pickle=trust_pickle)
    if fmt == "torch":
        return TorchCheckpoint(p, trust_pickle=trust_pickle)
    if fmt == "safetensors":
        return SafetensorsCheckpoint(p)
    raise UnsupportedFormatError(f"{p}: unknown format {fmt}")
