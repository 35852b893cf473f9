"""The checkpoint model: what a checkpoint holds, without its tensor data.

:func:`~dcpstudio.core.checkpoints.opening.open_checkpoint` builds a :class:`Checkpoint` for any format. Every
entry is keyed by its flattened fully-qualified name -- the key DCP uses (``model.layers.0.w`` for
``{"model": {"layers.0.w": ...}}``) -- so entries of different formats line up for ``diff``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..dtypes import DType
from ..pickles.unpicklers import gc_paused

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
    stored: int | None = None  # bytes stored for a tensor when it is a view of fewer (torch.save)
    # a lone shard of a larger tensor whose other shards are elsewhere: (its offsets, the extent seen)
    shard_of: tuple[tuple[int, ...], tuple[int, ...]] | None = None

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


EXPANDED_FLOOR = 64 << 20  # views this large may be written out...
EXPANDED_RATIO = 16  # ...unless they hold this many times the bytes they view


def expanded(entry: Entry) -> bool:
    """A view that repeats its stored bytes (stride 0, ``expand``) so much that writing or comparing
    its elements one by one would turn a small file into a huge output or a very long job."""
    return entry.stored is not None and entry.nbytes > max(EXPANDED_FLOOR, EXPANDED_RATIO * entry.stored)


def refuse_expanded(entry: Entry, label: str, doing: str, nbytes: int | None = None) -> None:
    """Raise for an :func:`expanded` entry (or a region of ``nbytes`` of it that is)."""
    size = entry.nbytes if nbytes is None else nbytes
    if entry.stored is not None and size > max(EXPANDED_FLOOR, EXPANDED_RATIO * entry.stored):
        from ..errors import UnsupportedFormatError

        raise UnsupportedFormatError(
            f"{label}: {entry.fqn!r} is an expanded view: {entry.numel} elements ({entry.nbytes} bytes) over "
            f"{entry.stored} stored bytes; refusing to {doing} it element by element (a torch.save target keeps it "
            "compact; or leave it out with --exclude)"
        )


_CONTROL = {i: f"\\x{i:02x}" for i in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}


def printable(text: str) -> str:
    """``text`` with control characters escaped: a name from a checkpoint cannot move the
    cursor, recolour or rewrite a terminal (or a label)."""
    out = text.translate(_CONTROL)
    return out if out.isprintable() else "".join(ch if ch.isprintable() else f"\\u{ord(ch):04x}" for ch in out)


def short_repr(value: Any, limit: int = 200) -> str:
    """A bounded ``repr``: never builds the full text of a huge value (a 256 MiB bytes object)."""
    out: list[str] = []
    size = 0

    def emit(text: str) -> bool:
        nonlocal size
        out.append(text)
        size += len(text)
        return size < limit

    def walk(v: Any, depth: int) -> bool:
        if isinstance(v, (bytes, bytearray)):
            return emit(repr(bytes(v[:40])) + (f"...<{len(v)} bytes>" if len(v) > 40 else ""))
        if isinstance(v, str):
            return emit(repr(v[:limit]) + ("..." if len(v) > limit else ""))
        if isinstance(v, (list, tuple, set, frozenset, dict)):
            if depth > 4:
                return emit("...")
            opener, closer = {list: ("[", "]"), tuple: ("(", ")"), frozenset: ("frozenset({", "})")}.get(
                type(v), ("{", "}")
            )
            if not emit(opener):
                return False
            items = list(v.items())[:20] if isinstance(v, dict) else list(v)[:20]
            for i, item in enumerate(items):
                if i and not emit(", "):
                    return False
                if isinstance(v, dict):
                    if not (walk(item[0], depth + 1) and emit(": ") and walk(item[1], depth + 1)):
                        return False
                elif not walk(item, depth + 1):
                    return False
            if len(v) > len(items):
                emit(f", ...<{len(v)} items>")
            if isinstance(v, tuple) and len(v) == 1:
                emit(",")
            return emit(closer)
        try:
            text = repr(v)
        except Exception:
            text = f"<{type(v).__name__}>"
        return emit(text[:limit])

    walk(value, 0)
    text = "".join(out)
    return printable(text if len(text) <= limit else text[: limit - 3] + "...")


@dataclass
class Totals:
    """Entries counted, their stored bytes, and of those the tensors' elements and bytes."""

    count: int = 0
    nbytes: int = 0
    params: int = 0
    tensor_bytes: int = 0

    def add(self, nbytes: int, params: int = 0, tensor_bytes: int = 0) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.params += params
        self.tensor_bytes += tensor_bytes

    def add_entry(self, entry: Entry) -> None:
        nbytes = entry.nbytes
        if entry.kind == "tensor":
            self.add(nbytes, entry.numel, nbytes)
        else:
            self.add(nbytes)


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
        nbytes = entry.nbytes
        params, tensor_bytes = (entry.numel, nbytes) if entry.kind == "tensor" else (0, 0)
        node.totals.add(nbytes, params, tensor_bytes)
        parts = _segments(fqn)
        for i, part in enumerate(parts):
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = Node(part, ".".join(parts[: i + 1]))
            node = child
            node.totals.add(nbytes, params, tensor_bytes)
        node.entry = entry  # a node may also have children: "a.b" and "a.b.c" can both exist
    return root


@functools.cache
def _zero_offsets(ndim: int) -> tuple[int, ...]:
    return (0,) * ndim


def whole_chunk(entry: Entry, file: str, data_offset: int) -> Chunk:
    """The single chunk of a tensor stored contiguously in one place (torch.save, safetensors)."""
    shape = entry.shape or ()
    return Chunk(_zero_offsets(len(shape)), shape, file, data_offset, entry.nbytes, data_offset)


def relative(path: Any, root: Any) -> str:
    """``path``'s name under the checkpoint ``root`` (a folder, or the file itself)."""
    if not isinstance(path, Path) or not isinstance(root, Path):  # remote: from the URLs, no request
        p, r = str(path), str(root)
        return p[len(r) + 1 :] if p.startswith(r + "/") else p.rsplit("/", 1)[-1]
    base = root if root.is_dir() else root.parent
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)
