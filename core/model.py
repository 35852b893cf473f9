"""The checkpoint model: what a checkpoint holds, without its tensor data.

:func:`~dcpstudio.core.inspect.open_checkpoint` builds a :class:`Checkpoint` for any format. Every
entry is keyed by its flattened fully-qualified name -- the key DCP uses (``model.layers.0.w`` for
``{"model": {"layers.0.w": ...}}``) -- so entries of different formats line up for ``diff``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._pickle import gc_paused
from .dtypes import DType

__all__ = ["Chunk", "Entry", "Kind", "Node", "Totals", "build_tree", "dtype_name"]

Kind = Literal["tensor", "bytes", "object"]


def dtype_name(dtype: Any) -> str | None:
    """``torch.bfloat16`` (or its :class:`~.dtypes.DType`) -> ``"bfloat16"``."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: a box of the global tensor and where its bytes are.

    ``offset``/``length`` is the byte range that holds the chunk in ``file`` (for DCP, the
    item's range: a small torch.save archive; for torch.save and safetensors, the raw bytes).
    ``data_offset`` is where the chunk's raw element bytes start, row-major, when known (always
    for torch.save and safetensors; for DCP after :meth:`Checkpoint.resolve_chunks`).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None = None
    offset: int | None = None
    length: int | None = None
    data_offset: int | None = None


@dataclass
class Entry:
    """One value of the checkpoint: a tensor, a DCP byte item, or a plain Python object."""

    fqn: str
    kind: Kind
    dtype: DType | None = None
    shape: tuple[int, ...] | None = None
    byte_size: int = 0  # stored size of a non-tensor value, when known
    storage: str | None = None  # torch.save: the storage record this tensor views
    storage_offset: int = 0
    stride: tuple[int, ...] | None = None
    shared_with: tuple[str, ...] = ()
    value: Any = None  # torch.save: the non-tensor value itself (already loaded with the pickle)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape or ():
            n *= s
        return n if self.kind == "tensor" else 0

    @property
    def nbytes(self) -> int:
        if self.kind == "tensor" and self.dtype is not None:
            return self.numel * self.dtype.itemsize
        return self.byte_size


@dataclass
class Totals:
    count: int = 0
    nbytes: int = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes


@dataclass
class Node:
    """A tree node: a name segment, its children, and the entry whose name ends here (if any).
    Totals cover the subtree."""

    name: str
    path: str
    children: dict[str, Node] = field(default_factory=dict)
    entry: Entry | None = None
    totals: Totals = field(default_factory=Totals)

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children.values():
            yield from child.walk()


def _segments(fqn: str) -> list[str]:
    return fqn.split(".") if fqn else [""]


def build_tree(entries: dict[str, Entry], root_name: str = "") -> Node:
    """Nest entries by the dots of their names; totals are summed up the tree."""
    with gc_paused():
        return _build_tree(entries, root_name)


def _build_tree(entries: dict[str, Entry], root_name: str) -> Node:
    root = Node(root_name, "")
    for fqn, entry in entries.items():
        node = root
        node.totals.add(entry.nbytes)
        parts = _segments(fqn)
        for i, part in enumerate(parts):
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = Node(part, ".".join(parts[: i + 1]))
            node = child
            node.totals.add(entry.nbytes)
        node.entry = entry  # a node may also have children: "a.b" and "a.b.c" can both exist
    return root


@functools.cache
def _zero_offsets(ndim: int) -> tuple[int, ...]:
    return (0,) * ndim


def whole_chunk(entry: Entry, file: str, data_offset: int) -> Chunk:
    """The single chunk of a tensor stored contiguously in one place (torch.save, safetensors)."""
    shape = entry.shape or ()
    return Chunk(_zero_offsets(len(shape)), shape, file, data_offset, entry.nbytes, data_offset)


def relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root if root.is_dir() else root.parent))
    except ValueError:
        return str(path)
