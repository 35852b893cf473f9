"""The :class:`Checkpoint` model every checkpoint kind implements, and what the kinds share.

A checkpoint's structure -- entries by fully-qualified name, each a tensor, a DCP byte item or a
plain value -- is known without reading tensor data or importing torch. Values are read one at a
time: :meth:`Checkpoint.tensor_ref` describes a tensor and where its bytes are (no torch);
:meth:`Checkpoint.read_tensor` makes a torch tensor of it or of a region of it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..formats.detect import Format
from ..io.files import file_size, open_member, open_regular
from ..io.raw import FileRange, read_exact
from ..io.remote.locations import RemotePath
from ..pickles.refs import StorageRef, TensorRef
from ..pickles.tensor_io import materialize, to_bytes
from ..pickles.tree import map_tensors
from .model import Chunk, Entry, Node, Totals, build_tree, dtype_name

__all__ = ["ROOT_KEY", "Checkpoint", "Region"]

Region = Sequence[slice]
ROOT_KEY = "<root>"


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


def _overlaps(
    offsets: Sequence[int], sizes: Sequence[int], tiles: Iterable[tuple[Sequence[int], Sequence[int]]]
) -> Iterator[tuple[int, list[int], list[int], list[int]]]:
    """For each tile ``(offsets, sizes)`` of a tensor that meets the box ``offsets + sizes``: its
    index, the overlap's offsets inside the tile, its sizes, and its offsets inside the box."""
    for k, (t_offsets, t_sizes) in enumerate(tiles):
        lo = [max(o, s) for o, s in zip(offsets, t_offsets, strict=True)]
        hi = [min(o + n, s + m) for o, n, s, m in zip(offsets, sizes, t_offsets, t_sizes, strict=True)]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        local = [a - s for a, s in zip(lo, t_offsets, strict=True)]
        size = [b - a for a, b in zip(lo, hi, strict=True)]
        yield k, local, size, [a - o for a, o in zip(lo, offsets, strict=True)]


def _place(out: torch.Tensor, at: Sequence[int], piece: torch.Tensor) -> None:
    """Copy ``piece`` into ``out`` at the offsets ``at``."""
    view = out
    for dim, (a, n) in enumerate(zip(at, piece.shape, strict=True)):
        view = view.narrow(dim, a, n)
    view.copy_(piece)


def _read(f: IO[bytes], offset: int, length: int, label: str) -> memoryview:
    buf = bytearray(length)
    read_exact(f, offset, memoryview(buf), label)
    return memoryview(buf)


class Checkpoint:
    """A checkpoint's structure, with methods to read its values one at a time.

    ``entries`` maps each flattened fully-qualified name to an :class:`Entry`. Use as a context
    manager (or call :meth:`close`) to release open files. A checkpoint is also the
    :class:`~..pickles.refs.StorageSource` of the tensor refs it hands out.
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
            key = dtype_name(e.dtype) if e.kind == "tensor" else "value"  # one word, whatever the format
            out.setdefault(key or "?", Totals()).add_entry(e)
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

    def early_tree(self) -> Node:
        """The tree, at once: a large DCP still reading its storage index gives the tree of its
        ``.metadata``'s head (the index, read later, must agree with it: :meth:`wait_index`)."""
        return self.tree

    def index_ready(self) -> bool:
        """Whether chunk tables are answered without waiting (False: a large DCP ``.metadata`` opened
        from its head, whose storage index is still being parsed -- :meth:`wait_index`)."""
        return True

    def wait_index(self) -> None:
        """Wait until the storage index is read (see :meth:`index_ready`), raising what is wrong with it."""

    def chunk_count(self, fqn: str) -> int:
        """How many chunks :meth:`chunks` lists, found as cheaply as the format allows."""
        return len(self.chunks(fqn))

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

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        """A non-tensor value as stored; tensors inside it stay :class:`TensorRef` (no torch).
        ``limit``: refuse (:class:`~..errors.DCPStudioError`) a value that would need more bytes
        than that to read -- what a listing asks of a value it only shows (formats that hold their
        values already read ignore it)."""
        raise NotImplementedError

    # -- values (torch) -----------------------------------------------------------------------------
    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        """One tensor, or the box ``region`` (a slice per leading dimension), read alone."""
        raise NotImplementedError

    def reads_in_place(self, fqn: str) -> bool:
        """Whether :meth:`read_into` reads only about the box's bytes (else it makes the whole
        tensor, or its storage, for every box)."""
        return False

    def read_into(self, fqn: str, region: Region | None, out: torch.Tensor) -> None:
        """:meth:`read_tensor` into ``out`` (contiguous, of the box's shape and the tensor's dtype),
        so a caller that reads many boxes reuses its memory; formats that store the tensor in place
        read straight into it."""
        out.copy_(self.read_tensor(fqn, region))

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
            if isinstance(name, (Path, RemotePath)):
                f = self._files[key] = open_regular(name)
            else:
                f = self._files[key] = open_member(self._root, name, self._what)
        return f

    def size(self, relative_path: str) -> int:
        return file_size(self.get(relative_path))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


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
