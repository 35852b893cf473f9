"""safetensors checkpoints as a :class:`~.base.Checkpoint`: one file, shards with an index, or
torch's distributed HF layout (shards placed by ``DCP_SHARDING_INFO``) assembled into full tensors."""

from __future__ import annotations

from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..errors import CorruptCheckpointError
from ..formats.dcp.files import check_tiling
from ..formats.detect import Format
from ..formats.safetensors import SHARDING_KEY, SafetensorsTensor, read_safetensors_index
from ..formats.values import ENCODING_KEY, VALUES_KEY, decode_values
from ..io.buffers import new_tensor
from ..io.raw import FileRange, read_box, read_exact, source_of
from ..pickles.refs import StorageRef
from ..pickles.tensor_io import to_bytes
from .base import Checkpoint, Region, _box, _OpenFiles, _overlaps, _place, _read, _row_slabs
from .model import Chunk, Entry, relative

__all__ = ["SafetensorsCheckpoint"]

_NOT_CARRIED = frozenset({VALUES_KEY, ENCODING_KEY, SHARDING_KEY})


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

    def chunk_count(self, fqn: str) -> int:
        return len(self._local(fqn))

    def chunks(self, fqn: str) -> list[Chunk]:
        return [
            Chunk(t.offsets, t.shape, relative(t.file, self.path), t.data_offset, t.nbytes, t.data_offset)
            for t in self._local(fqn)
        ]

    def _file(self, path: Path) -> IO[bytes]:
        return self._files.get(path)  # checked inside the checkpoint when the index was read

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        entry = self.tensor_entry(fqn)
        offsets, sizes = _box(entry, region)
        parts = self._local(fqn)
        if len(parts) == 1:
            t = parts[0]
            return read_box(self._file(t.file), t.data_offset, t.shape, t.dtype, offsets, sizes, str(t.file))
        assert entry.dtype is not None
        out = new_tensor(sizes, entry.dtype.torch)  # the shards tile it
        for k, local, size, at in _overlaps(offsets, sizes, [(t.offsets, t.shape) for t in parts]):
            t = parts[k]
            _place(out, at, read_box(self._file(t.file), t.data_offset, t.shape, t.dtype, local, size, str(t.file)))
        return out

    def reads_in_place(self, fqn: str) -> bool:
        return self.entry(fqn).kind == "tensor"

    def read_into(self, fqn: str, region: Region | None, out: torch.Tensor) -> None:
        parts = self._local(fqn)
        if len(parts) != 1:
            super().read_into(fqn, region, out)
            return
        offsets, sizes = _box(self.tensor_entry(fqn), region)
        t = parts[0]
        read_box(self._file(t.file), t.data_offset, t.shape, t.dtype, offsets, sizes, str(t.file), out)

    def storage_range(self, ref: StorageRef) -> FileRange | None:
        parts = self._local(ref.key)
        if len(parts) != 1:
            return None
        t = parts[0]
        return FileRange(source_of(self._file(t.file)), t.data_offset, t.nbytes)

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

    def header_metadata(self) -> tuple[dict[str, str], list[str]]:
        """The files' own ``__metadata__`` as one map, to carry into a safetensors output (torchao's
        quantization records, without which ``from_pretrained`` fails; transformers' ``format``):
        all but DCP Studio's stored values (decoded into entries, written again from them) and
        torch's shard layout (``DCP_SHARDING_INFO``, the source's own). Also the keys on which two
        files disagree (the first file's value kept), for the caller to say so."""
        out: dict[str, str] = {}
        differ: list[str] = []
        for file_meta in self.info.get("metadata", {}).values():
            for key, value in file_meta.items():
                if key in _NOT_CARRIED:
                    continue
                if out.setdefault(key, value) != value and key not in differ:
                    differ.append(key)
        return out, differ

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        entry = self.entry(fqn)
        return entry.value if entry.kind == "object" else self.tensor_ref(fqn)

    def close(self) -> None:
        self._files.close()
