"""torch.save files -- one, or a directory of shards with ``pytorch_model.bin.index.json`` -- as a
:class:`~.base.Checkpoint`: tensors are the file's own views (:class:`TensorRef`), values its own."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..dtypes import DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..formats.detect import TORCH_INDEX_SUFFIXES, Format
from ..formats.torchsave.archive import TorchSaveFile
from ..io.blocks import WINDOW_BUDGET, box_slices, strided_pieces
from ..io.buffers import new_tensor
from ..io.files import member_path, read_regular
from ..io.raw import read_box, read_exact, tensor_buffer
from ..pickles.dtensor import DTensorRef
from ..pickles.refs import TensorRef
from ..pickles.stand_ins import UnreadableRef
from ..pickles.subclass import SubclassRef
from ..pickles.tensor_io import materialize
from ..pickles.tree import flatten_state_dict
from ._subclasses import Item, expand_subclass
from .base import ROOT_KEY, Checkpoint, Region, _box
from .model import Chunk, Entry, refuse_expanded, relative

__all__ = ["TorchCheckpoint", "torch_index"]


class TorchCheckpoint(Checkpoint):
    """A torch.save file -- or a directory of them with an index (``pytorch_model.bin.index.json``,
    as transformers shards large models), whose flat state dicts are read as one."""

    format: Format = "torch"

    def __init__(self, path: Path, *, trust_pickle: bool = False, dequantize: bool = False) -> None:
        index = torch_index(path)
        files = _index_files(index) if index is not None else [path]
        self._files: list[TorchSaveFile] = []
        self._file_of: dict[str, TorchSaveFile] = {}
        self._values: dict[str, Any] = {}
        self._paths: dict[str, tuple[str | int, ...]] = {}
        self.placed: dict[str, tuple[DTensorRef, tuple[int, ...]]] = {}  # DTensor shards: spec, offsets
        self._window = _Window()
        self._dequantize = dequantize
        self._whole = True
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
                if fqn in self.placed and value.shape != self.placed[fqn][0].shape:
                    entries[fqn].shard_of = (self.placed[fqn][1], self.placed[fqn][0].shape)
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
        items: list[Item] = [(fqn, value, paths[fqn], None) for fqn, value in flat.items()]
        if any(isinstance(v, SubclassRef) and v.cls is not None for v in flat.values()):
            self._whole = False  # its names are no longer the object's
            items = [
                out
                for fqn, value, path, _ in items
                for out in (
                    expand_subclass(fqn, value, path, self._dequantize, tsf.label)
                    if isinstance(value, SubclassRef)
                    else [(fqn, value, path, None)]
                )
            ]
        for fqn, value, path, holder in items:
            if isinstance(value, DTensorRef):
                value = self._place(file, fqn, value)
            if fqn in self._values:
                raise CorruptCheckpointError(f"{file}: {fqn!r} is also in {Path(self._file_of[fqn].label).name}")
            self._values[fqn] = value
            self._paths[fqn] = path
            self._file_of[fqn] = holder or tsf
            if holder is not None:
                self._files.append(holder)

    def _place(self, file: Path, fqn: str, dt: DTensorRef) -> TensorRef:
        """A DTensor's local shard, its place in the global tensor noted in :attr:`placed`."""
        try:
            offsets, _ = dt.box()
        except (CorruptCheckpointError, UnsupportedFormatError) as e:
            raise type(e)(f"{file}: {fqn!r} is {e}") from e
        assert dt.local is not None
        self.placed[fqn] = (dt, offsets)
        return dt.local

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        return dict(self._paths)

    @property
    def obj(self) -> Any:
        """The whole object a single file holds (tensors as :class:`TensorRef`); None for shards."""
        return self._files[0].obj if len(self._files) == 1 and self._whole and "index" not in self.info else None

    def chunk_count(self, fqn: str) -> int:
        entry = self.entry(fqn)
        return 1 if entry.kind == "tensor" and self._values[fqn].storage is not None else 0

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
        if ref.storage is None:
            raise UnsupportedFormatError(
                f"{self._file_of[fqn].label}: {fqn!r} is a tensor on the meta device (saved without data): it has no "
                "values to read or write; leave it out with --exclude"
            )
        return ref

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        """A region of a tensor whose bytes lie in place -- stored in row-major order, or in a
        permutation of it (a transposed or channels-last tensor) -- reads only about the region's
        bytes (a deflated record's from the temporary file it is inflated into); other views of bytes
        in place (with gaps, overlapping) are copied out of a bounded window of their storage
        (:class:`_Window`); tensors of byte-swapped records and expanded views are made from their
        whole storage."""
        import torch

        entry = self.tensor_entry(fqn)
        offsets, sizes = _box(entry, region)
        ref = self.tensor_ref(fqn)
        file = self._file_of[fqn]
        where = file.storage_file(ref.storage) if ref.storage is not None and ref.numel else None
        order = _dense_order(ref)
        if where is not None and order is not None:

            def read(out: torch.Tensor | None) -> torch.Tensor:
                assert where is not None and order is not None
                at, shape = where[1] + ref.byte_offset, [ref.shape[d] for d in order]
                box = [offsets[d] for d in order], [sizes[d] for d in order]
                return read_box(where[0], at, shape, ref.dtype, *box, file.label, out)

            if order == sorted(order):
                return read(None)
            return self._window.permuted(read, sizes, ref.dtype, [order.index(d) for d in range(len(order))])
        t = ref.narrow(offsets, sizes)
        refuse_expanded(entry, self.label, "read", t.nbytes)
        if where is not None:
            return self._window.read(file, where, ref, offsets, sizes)
        full = materialize(t)
        file.release()
        return full.clone(memory_format=torch.contiguous_format)

    def _in_place(self, fqn: str) -> tuple[Any, int] | None:
        """The open file and the offset of a contiguous tensor stored verbatim in it (or inflated
        into a temporary file)."""
        ref = self.tensor_ref(fqn)
        file = self._file_of[fqn]
        where = file.storage_file(ref.storage) if ref.storage is not None and ref.numel else None
        return (where[0], where[1] + ref.byte_offset) if where is not None and ref.is_contiguous() else None

    def reads_in_place(self, fqn: str) -> bool:
        return self.entry(fqn).kind == "tensor" and self._in_place(fqn) is not None

    def read_into(self, fqn: str, region: Region | None, out: torch.Tensor) -> None:
        found = self._in_place(fqn)
        if found is None:
            super().read_into(fqn, region, out)
            return
        f, at = found
        ref = self.tensor_ref(fqn)
        offsets, sizes = _box(self.tensor_entry(fqn), region)
        read_box(f, at, ref.shape, ref.dtype, offsets, sizes, self._file_of[fqn].label, out)

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        value = self._values[self.entry(fqn).fqn]
        if isinstance(value, SubclassRef):
            raise UnsupportedFormatError(f"{self._file_of[fqn].label}: {fqn!r} is {value.advice(fqn)}")
        if isinstance(value, UnreadableRef):
            raise UnsupportedFormatError(
                f"{self._file_of[fqn].label}: {fqn!r} is {value.reason}; leave it out with --exclude"
            )
        return value

    def read_value(self, fqn: str) -> Any:
        out = super().read_value(fqn)
        for file in self._files:
            file.release()
        return out

    def close(self) -> None:
        self._window.clear()
        for file in self._files:
            file.close()


class _Window:
    """At most :data:`WINDOW_BUDGET` bytes of one storage, read in place from its file, that the
    views of it are copied out of (:func:`strided_pieces`): a view in any order or with gaps reads
    only a window at a time, never its whole storage, and the views of one small storage read
    one after another (a fan-out of names) read it once. One window serves a whole checkpoint,
    so memory stays bounded however many files or entries it has; a lock keeps one reader at a
    time, as the window is refilled in place."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._at: tuple[TorchSaveFile, str, int, int] | None = None  # file, storage key, byte range

    def read(
        self, file: TorchSaveFile, where: tuple[IO[bytes], int], ref: TensorRef, offsets: list[int], sizes: list[int]
    ) -> torch.Tensor:
        """The box ``offsets + sizes`` of ``ref``, whose storage lies at ``where`` in ``file``: contiguous."""
        dt: DType = ref.dtype
        out = new_tensor(sizes, dt.torch)
        storage = ref.storage
        assert storage is not None
        total = storage.nbytes // dt.itemsize  # the storage's length in elements of the view's dtype
        reach = max(1, WINDOW_BUDGET // dt.itemsize)
        first = ref.storage_offset + sum(o * st for o, st in zip(offsets, ref.stride, strict=True))
        with self._lock:
            for at, part in strided_pieces(sizes, ref.stride, reach):
                lo = first + sum(o * st for o, st in zip(at, ref.stride, strict=True))
                hi = lo + sum((n - 1) * st for n, st in zip(part, ref.stride, strict=True)) + 1
                start = self._hold(file, where, storage.key, (lo, hi), total, dt)
                src = self._values(dt).as_strided(part, ref.stride, lo - start)
                out[tuple(box_slices(at, part))].copy_(src)
        return out

    def permuted(
        self, read: Callable[[torch.Tensor | None], torch.Tensor], sizes: list[int], dt: DType, perm: list[int]
    ) -> torch.Tensor:
        """A box of ``sizes`` that ``read`` reads in storage order (into a given tensor, or a new
        one), permuted by ``perm`` into a contiguous tensor. A box that fits is read into the
        window's buffer: each block of a transposed tensor costs no fresh memory but its result."""
        import torch

        nbytes = math.prod(sizes) * dt.itemsize
        if nbytes > WINDOW_BUDGET:
            return read(None).permute(perm).contiguous()
        stored = [sizes[perm.index(d)] for d in range(len(sizes))]
        with self._lock:
            self._at = None
            if self._buf is None or self._buf.numel() < nbytes:
                self._buf = None
                self._buf = torch.empty(nbytes, dtype=torch.uint8)
            box = read(self._buf[:nbytes].view(dt.torch).view(stored))
            return new_tensor(sizes, dt.torch).copy_(box.permute(perm))

    def _hold(
        self, file: TorchSaveFile, where: tuple[IO[bytes], int], key: str, span: tuple[int, int], total: int, dt: DType
    ) -> int:
        """Have elements ``lo:hi`` of the storage (``total`` of them) in the window, reading from ``lo``
        on as far as the window reaches; the element the window starts at."""
        import torch

        lo, hi = span
        size = dt.itemsize
        reach = max(1, WINDOW_BUDGET // size)
        held = self._at
        if (
            held is not None
            and held[:2] == (file, key)
            and held[2] % size == 0
            and held[2] <= lo * size < hi * size <= held[3]
        ):
            return held[2] // size
        start = min(lo, max(0, total - reach))
        end = min(total, start + reach)
        nbytes = (end - start) * size
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        self._at = None
        read_exact(where[0], where[1] + start * size, tensor_buffer(self._buf[:nbytes]), file.label)
        self._at = (file, key, start * size, end * size)
        return start

    def _values(self, dt: DType) -> torch.Tensor:
        assert self._buf is not None and self._at is not None
        return self._buf[: (self._at[3] - self._at[2]) // dt.itemsize * dt.itemsize].view(dt.torch)

    def clear(self) -> None:
        with self._lock:
            self._buf = self._at = None


def _dense_order(t: TensorRef) -> list[int] | None:
    """The dimensions from outermost to innermost in storage when ``t`` is a permutation of a
    row-major tensor (no gaps, no overlaps: contiguous, transposed, channels-last), else None."""
    order = sorted(range(len(t.shape)), key=lambda d: (-t.stride[d], d))
    step = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride[d] != step:
            return None
        step *= t.shape[d]
    return order


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
