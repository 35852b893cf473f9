"""Open any checkpoint as a :class:`Checkpoint` model and read single tensors or values from it.

Opening reads only structure: DCP's ``.metadata`` (restricted, into light records), torch.save's
pickle (weights-only, tensors as meta tensors) or safetensors headers. Tensor data is read on
request, one tensor or one region at a time, touching only the bytes that hold it.
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ._io import FileRange, read_box, read_exact
from ._pickle import gc_paused, load_light_metadata, load_light_metadata_head, load_metadata_pickle
from ._tree import map_tensors
from .errors import CorruptCheckpointError, UnsupportedFormatError
from .formats.dcp import METADATA_FILE, DCPReader, _open_chunk
from .formats.detect import Format, detect_format
from .formats.safetensors import read_safetensors_index
from .formats.torchsave import TorchSaveFile
from .model import Chunk, Entry, Node, Totals, build_tree, dtype_name, relative, whole_chunk
from .planners import RegionPlanner, safe_torch_load

__all__ = ["Checkpoint", "Region", "open_checkpoint"]

Region = Sequence[slice]
ROOT_KEY = "<root>"
_HEAD_ONLY_ABOVE = 4 << 20  # .metadata sizes past which the storage index is parsed lazily


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


class Checkpoint:
    """A checkpoint's structure, with methods to read its values one at a time.

    ``entries`` maps each flattened fully-qualified name to an :class:`Entry`. Use as a context
    manager (or call :meth:`close`) to release open files.
    """

    format: Format

    def __init__(self, path: Path, entries: dict[str, Entry], info: dict[str, Any] | None = None) -> None:
        self.path = path
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

    def chunks(self, fqn: str) -> list[Chunk]:
        """How a tensor is stored: its chunks, with file and byte range."""
        raise NotImplementedError

    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        """:meth:`chunks` with ``data_offset`` filled in (DCP parses each chunk's archive)."""
        return self.chunks(fqn)

    # -- values -----------------------------------------------------------------------------------
    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        """One tensor, or the box ``region`` (a slice per leading dimension), read alone."""
        raise NotImplementedError

    def read_value(self, fqn: str) -> Any:
        """A non-tensor value (DCP byte item or torch.save object), unpickled safely."""
        raise NotImplementedError

    def file_range(self, fqn: str) -> FileRange | None:
        """Where a whole tensor's raw row-major bytes lie verbatim in one file, so a converter can
        copy them without reading them; None when they do not (sharded, non-contiguous, ...)."""
        return None

    def close(self) -> None:
        """Release open files."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


class DCPCheckpoint(Checkpoint):
    format: Format = "dcp"

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        md_path = path / METADATA_FILE
        try:
            data = md_path.read_bytes()
        except OSError as e:
            raise CorruptCheckpointError(f"{md_path}: cannot read ({e.strerror or e})") from e
        label = str(md_path)
        md: Any = None
        if trust_pickle:
            md = load_metadata_pickle(data, label, trust=True)
        elif len(data) > _HEAD_ONLY_ABOVE:
            md = load_light_metadata_head(data, label)  # storage index parsed on first use
        if md is None:
            md = load_light_metadata(data, label)
        sdm = getattr(md, "state_dict_metadata", None)
        if not isinstance(sdm, dict):
            raise CorruptCheckpointError(f"{md_path}: does not hold DCP metadata")
        self._data = data
        entries: dict[str, Entry] = {}
        try:
            with gc_paused():
                for fqn, smd in sdm.items():
                    if hasattr(smd, "chunks"):
                        entries[fqn] = Entry(fqn, "tensor", smd.properties.dtype, tuple(smd.size))
                    else:
                        entries[fqn] = Entry(fqn, "bytes")
        except (AttributeError, TypeError) as e:
            raise CorruptCheckpointError(f"{md_path}: damaged metadata entry ({e})") from e
        super().__init__(path, entries, {"version": getattr(md, "version", None)})
        self._md = md
        self._trust = trust_pickle
        self._index: dict[str, dict[tuple[int, ...], Any]] | None = None
        self._files: dict[str, IO[bytes]] = {}

    @_damaged_metadata
    @_damaged_metadata
    def _storage(self) -> dict[str, dict[tuple[int, ...], Any]]:
        """fqn -> chunk offsets -> storage info, built on first use. A large ``.metadata`` is
        opened without its storage index; this parses the whole pickle then (100k tensors: ~1.5 s)."""
        if self._index is None:
            storage_data = getattr(self._md, "storage_data", None)
            if storage_data is None:
                storage_data = getattr(
                    load_light_metadata(self._data, str(self.path / METADATA_FILE)), "storage_data", None
                )
            if not isinstance(storage_data, dict):
                raise CorruptCheckpointError(f"{self.path / METADATA_FILE}: has no storage index")
            self._data = b""
            index: dict[str, dict[tuple[int, ...], Any]] = {}
            for key, info in storage_data.items():
                offset = getattr(key, "offset", None)  # absent for byte items
                index.setdefault(key.fqn, {})[tuple(offset) if offset is not None else ()] = info
            for fqn, entry in self.entries.items():
                if entry.kind == "bytes":
                    info = index.get(fqn, {}).get(())
                    entry.byte_size = int(getattr(info, "length", 0) or 0)
            self._index = index
        return self._index

    @functools.cached_property
    def tree(self) -> Node:
        self._storage()  # byte items' sizes count in the totals
        return build_tree(self.entries, self.path.name)

    def _descriptors(self, fqn: str, offsets: tuple[int, ...]) -> list[str] | None:
        """Stream transforms (e.g. zstd) applied to a stored item, None when it is stored plain."""
        descriptors = getattr(self._info(fqn, offsets), "transform_descriptors", None)
        return list(descriptors) if descriptors else None

    def _info(self, fqn: str, offsets: tuple[int, ...]) -> Any:
        info = self._storage().get(fqn, {}).get(offsets)
        if info is None:
            raise CorruptCheckpointError(f"{self.path}: no storage entry for {fqn} at {list(offsets)}")
        return info

    @_damaged_metadata
    def chunks(self, fqn: str) -> list[Chunk]:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            info = self._info(fqn, ())
            return [Chunk((), (), info.relative_path, info.offset, info.length)]
        out = []
        for c in self._md.state_dict_metadata[fqn].chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            info = self._info(fqn, offsets)
            out.append(Chunk(offsets, sizes, info.relative_path, info.offset, info.length))
        return out

    @_damaged_metadata
    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        out = []
        files: dict[str, IO[bytes]] = {}
        try:
            for c in self.chunks(fqn):
                if (
                    self.entries[fqn].kind != "tensor"
                    or c.file is None
                    or c.offset is None
                    or c.length is None
                    or self._descriptors(fqn, c.offsets)  # transformed (compressed): no raw bytes in place
                ):
                    out.append(c)
                    continue
                f = files.get(c.file)
                if f is None:
                    f = files[c.file] = open(self.path / c.file, "rb")  # noqa: SIM115
                parsed = _open_chunk(f, c.offset, c.length, f"{self.path / c.file} ({fqn})")
                out.append(Chunk(c.offsets, c.sizes, c.file, c.offset, c.length, parsed.raw_offset()))
        except OSError as e:
            raise CorruptCheckpointError(f"{self.path}: cannot read chunk of {fqn} ({e.strerror or e})") from e
        finally:
            for f in files.values():
                f.close()
        return out

    def _file(self, relative_path: str) -> IO[bytes]:
        f = self._files.get(relative_path)
        if f is None:
            path = self.path / relative_path
            try:
                f = self._files[relative_path] = open(path, "rb")  # noqa: SIM115 - closed by close()
            except OSError as e:
                raise CorruptCheckpointError(f"{path}: cannot open DCP data file ({e.strerror or e})") from e
        return f

    @_damaged_metadata
    def file_range(self, fqn: str) -> FileRange | None:
        entry = self.entry(fqn)
        chunks = self.chunks(fqn) if entry.kind == "tensor" else []
        if len(chunks) != 1 or any(chunks[0].offsets) or chunks[0].sizes != entry.shape:
            return None
        c = chunks[0]
        if self._descriptors(fqn, c.offsets):
            return None
        f = self._file(c.file or "")
        parsed = _open_chunk(f, c.offset or 0, c.length or 0, f"{self.path / (c.file or '')} ({fqn})")
        return parsed.file_range(f.fileno(), cast(torch.dtype, entry.dtype), entry.shape or ())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    @_damaged_metadata
    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            raise ValueError(f"{fqn} is not a tensor")
        offsets, sizes = _box(entry, region)
        dtype = cast(torch.dtype, entry.dtype)
        target = torch.empty(sizes, dtype=dtype)
        if target.numel() == 0:
            return target
        chunks = self.chunks(fqn)
        md = TensorStorageMetadata(
            TensorProperties(dtype=dtype),
            torch.Size(entry.shape or ()),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks],
        )
        reader = DCPReader(self.path, trust_pickle=self._trust)
        reader.storage_data = {
            MetadataIndex(fqn, torch.Size(c.offsets)): _StorageInfo(
                c.file or "", c.offset or 0, c.length or 0, self._descriptors(fqn, c.offsets)
            )
            for c in chunks
        }
        box = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        items = create_read_items_for_chunk_list(fqn, md, [box])
        reader.read_data(LoadPlan(items), RegionPlanner(target)).wait()
        return target

    def read_value(self, fqn: str) -> Any:
        entry = self.entry(fqn)
        if entry.kind == "tensor":
            return self.read_tensor(fqn)
        info = self._info(fqn, ())
        raw = bytearray(info.length)
        path = self.path / info.relative_path
        try:
            with open(path, "rb") as f:
                read_exact(f, info.offset, memoryview(raw), str(path))
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: cannot read value {fqn} ({e.strerror or e})") from e
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:  # e.g. zstd-compressed items: undo the transforms torch's writer applied
            stream = DCPReader(self.path).transforms.transform_load_stream(None, descriptors, io.BytesIO(raw))  # type: ignore[arg-type]
            raw = bytearray(stream.read())
        return safe_torch_load(io.BytesIO(raw), f"{path} ({fqn})", trust=self._trust)


class TorchCheckpoint(Checkpoint):
    format: Format = "torch"

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        self._file = TorchSaveFile(path, trust_pickle=trust_pickle)
        obj = self._file.obj
        try:
            flat, _ = flatten_state_dict(obj) if isinstance(obj, dict) else ({ROOT_KEY: obj}, None)
        except (ValueError, RecursionError) as e:
            self._file.close()
            raise CorruptCheckpointError(f"{path}: cannot flatten its names ({type(e).__name__}: {e})") from e
        self._values = flat
        entries: dict[str, Entry] = {}
        by_storage: dict[str, list[str]] = {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                ref = self._file.storages.ref_of(value)
                key = ref.key if ref is not None else None
                entries[fqn] = Entry(
                    fqn,
                    "tensor",
                    value.dtype,
                    tuple(value.shape),
                    storage=key,
                    storage_offset=int(value.storage_offset()),
                    stride=tuple(value.stride()),
                )
                if key is not None:
                    by_storage.setdefault(key, []).append(fqn)
            else:
                entries[fqn] = Entry(fqn, "object", value=value)
        for names in by_storage.values():
            if len(names) > 1:
                for name in names:
                    entries[name].shared_with = tuple(n for n in names if n != name)
        super().__init__(path, entries, {"format": self._file.format})

    def chunks(self, fqn: str) -> list[Chunk]:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            return []
        t = self._values[fqn]
        ref = self._file.storages.ref_of(t)
        if ref is None:
            return []
        offset, size = self._file.location(ref)
        contiguous = t.is_contiguous()
        data = offset + entry.storage_offset * t.element_size() if contiguous else None
        shape = entry.shape or ()
        return [Chunk((0,) * len(shape), shape, self.path.name, offset, size, data)]

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            raise ValueError(f"{fqn} is not a tensor")
        offsets, sizes = _box(entry, region)
        out = self._file.read_contiguous(narrow_tensor_by_index(self._values[fqn], offsets, sizes))
        if out is not None:
            return out
        full = self._file.materialize(self._values[fqn])
        self._file.release()
        return narrow_tensor_by_index(full, offsets, sizes).clone(memory_format=torch.contiguous_format)

    def file_range(self, fqn: str) -> FileRange | None:
        value = self._values[self.entry(fqn).fqn]
        return self._file.view_range(value) if isinstance(value, torch.Tensor) else None

    def read_value(self, fqn: str) -> Any:
        value = self._values[self.entry(fqn).fqn]
        out = map_tensors(value, self._file.materialize)
        self._file.release()
        return out

    def close(self) -> None:
        self._file.close()


VALUES_KEY = "dcpstudio.values"


def _stored_values(meta: dict[str, str], path: Path) -> dict[str, Any]:
    """Non-tensor values DCP Studio stored as JSON in a safetensors header (see export)."""
    raw = meta.get(VALUES_KEY)
    if raw is None:
        return {}
    try:
        values = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: damaged {VALUES_KEY} metadata ({e})") from e
    if not isinstance(values, dict):
        raise CorruptCheckpointError(f"{path}: {VALUES_KEY} metadata is not a JSON object")
    return values


class SafetensorsCheckpoint(Checkpoint):
    format: Format = "safetensors"

    def __init__(self, path: Path) -> None:
        tensors, info = read_safetensors_index(path)
        entries = {}
        self._where = {}
        for t in tensors:
            if t.name in entries:
                raise CorruptCheckpointError(f"{path}: tensor {t.name!r} appears in two files")
            entries[t.name] = Entry(t.name, "tensor", t.dtype, t.shape)
            self._where[t.name] = t
        for file_meta in info.get("metadata", {}).values():
            for fqn, value in _stored_values(file_meta, path).items():
                entries.setdefault(fqn, Entry(fqn, "object", value=value))
        super().__init__(path, entries, info)
        self._files: dict[Path, IO[bytes]] = {}

    def chunks(self, fqn: str) -> list[Chunk]:
        t = self._where[self.entry(fqn).fqn]
        return [whole_chunk(self.entries[fqn], relative(t.file, self.path), t.data_offset)]

    def _file(self, path: Path) -> IO[bytes]:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb")  # noqa: SIM115 - closed by close()
        return f

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        entry = self.entry(fqn)
        if entry.kind != "tensor":
            raise ValueError(f"{fqn} is not a tensor")
        t = self._where[fqn]
        offsets, sizes = _box(entry, region)
        return read_box(self._file(t.file), t.data_offset, t.shape, t.dtype, offsets, sizes, str(t.file))

    def file_range(self, fqn: str) -> FileRange | None:
        t = self._where.get(self.entry(fqn).fqn)
        return None if t is None else FileRange(self._file(t.file).fileno(), t.data_offset, t.nbytes)

    def read_value(self, fqn: str) -> Any:
        entry = self.entry(fqn)
        return entry.value if entry.kind == "object" else self.read_tensor(fqn)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


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
