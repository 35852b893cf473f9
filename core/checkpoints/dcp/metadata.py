"""How a DCP checkpoint's ``.metadata`` becomes its entries and :class:`DCPIndex`: from the
restricted pickle (its head first when it is large), or -- for a large one already parsed
unchanged -- from the user's index cache (:mod:`dcpstudio.core.io.index_cache`), with no pickle
read at all."""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...dtypes import dtype_of
from ...errors import CorruptCheckpointError
from ...formats.dcp.files import METADATA_FILE, METADATA_LIMIT
from ...formats.dcp.index import DCPIndex, small_ints
from ...io import index_cache as _index_cache
from ...io.files import read_with_stat
from ...pickles.refs import TensorRef
from ...pickles.unpicklers import gc_paused, load_light_metadata
from ..model import Chunk, Entry
from .fast import Head, fast_head, fast_index, same_head

__all__ = [
    "CACHE_ABOVE",
    "CHILD_ABOVE",
    "HEAD_ONLY_ABOVE",
    "ambiguous",
    "byte_size",
    "cached_index",
    "check_head",
    "check_stored",
    "damaged_metadata",
    "dispose",
    "entries_from_index",
    "entries_from_metadata",
    "full_after_head",
    "head_first",
    "index_from_bytes",
    "index_of",
    "open_fast",
    "read_keyed",
    "same_entries",
    "same_metadata",
    "store_index",
]

HEAD_ONLY_ABOVE = 4 << 20  # .metadata sizes past which the storage index is parsed lazily
CACHE_ABOVE = HEAD_ONLY_ABOVE  # .metadata sizes whose index is kept in the user's cache
CHILD_ABOVE = HEAD_ONLY_ABOVE  # .metadata sizes parsed in a child process (see build_in_child)
IN_CHILD = False  # set in that child: parse in-process, store nothing
_CACHE_KIND = "dcp-metadata"


def read_keyed(
    md_path: Any, label: str
) -> tuple[bytes, dict[str, Any] | None, tuple[DCPIndex, dict[str, Entry]] | None]:
    """A ``.metadata``'s bytes, the cache key of exactly those bytes when it is large enough to cache
    (the status of the descriptor they were read through, and their digest), and the index cached
    under it. A remote object's cached index is found by its ETag before anything is fetched (then no
    bytes are read: ``b""``)."""
    before = None if isinstance(md_path, Path) else _index_cache.identity(md_path, _CACHE_KIND)
    cached = cached_index(before)
    if cached is not None:
        return b"", before, cached
    data, st = read_with_stat(md_path, METADATA_LIMIT, label)
    if len(data) <= CACHE_ABOVE:
        return data, None, None
    key = _index_cache.source_key(md_path, _CACHE_KIND, data, st, before=before)
    return data, key, None if before is not None else cached_index(key)


def same_metadata(head: Any, full: Any) -> bool:
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


def byte_size(index: DCPIndex, fqn: str) -> int:
    rows = index.chunks(fqn) if index.error(fqn) is None else []
    return rows[0][2].length if rows and rows[0][2] is not None else 0


def entries_from_index(index: DCPIndex) -> dict[str, Entry]:
    """The entries a cached index lists (``ValueError`` / ``IndexError`` for what it cannot hold)."""
    dims, starts, kinds = index.dims.tolist(), index.shape_start.tolist(), index.dtype.tolist()
    dtypes = [dtype_of(name) for name in index.dtype_names]
    if dims and min(dims) < 0:
        raise ValueError("bad shape")
    entries: dict[str, Entry] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape
    new, ends = Entry, iter(starts)
    next(ends, None)
    for name, d, start, end in zip(index.names, kinds, starts, ends, strict=False):  # ends: starts[1:]
        if d < 0:
            entries[name] = new(name, "bytes", byte_size=byte_size(index, name))
        else:
            shape = tuple(dims[start:end])
            entries[name] = new(name, "tensor", dtypes[d], shapes.setdefault(shape, shape))
    if len(entries) != len(index.names):
        raise ValueError("an entry is listed twice")
    return entries


def cached_index(key: dict[str, Any] | None) -> tuple[DCPIndex, dict[str, Entry]] | None:
    """The index cached under ``key`` (:func:`read_keyed`), with its entries; None when there is none."""
    found = _index_cache.load(key)
    if found is None:
        return None
    try:
        with gc_paused():
            index = DCPIndex.from_bytes(found[1])
            entries = entries_from_index(index)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, struct.error, RecursionError):
        return None  # not what this version writes: rebuilt from the pickle
    return index, entries


def entries_from_metadata(md: Any, label: str) -> dict[str, Entry]:
    """The entries light metadata records list (names, dtypes, shapes), checked."""
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise CorruptCheckpointError(f"{label}: does not hold DCP metadata")
    entries: dict[str, Entry] = {}
    try:
        with gc_paused():
            for fqn, smd in sdm.items():
                if not isinstance(fqn, str):
                    raise TypeError(f"entry name {fqn!r} is not a string")
                if hasattr(smd, "chunks"):
                    entries[fqn] = Entry(fqn, "tensor", dtype_of(smd.properties.dtype), small_ints(smd.size))
                else:
                    entries[fqn] = Entry(fqn, "bytes")
    except (AttributeError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{label}: damaged metadata entry ({e})") from e
    return entries


def dispose(md: Any) -> None:
    """Free a large metadata object graph piece by piece, from Python code. Dropped at once, its
    millions of objects are freed in one C-level pass that holds the GIL for up to a second (a
    window's GUI thread freezes meanwhile); between these steps other threads get their turns."""
    fields = getattr(md, "__dict__", {})
    for name in ("storage_data", "state_dict_metadata", "planner_data"):
        items = fields.get(name)
        if isinstance(items, dict):
            while items:
                items.popitem()


def head_first(size: int, trust: bool) -> bool:
    """Whether to open a ``.metadata`` of ``size`` bytes from its head, its storage index later."""
    return size > HEAD_ONLY_ABOVE and not trust and not IN_CHILD


def same_entries(found: dict[str, Entry], entries: dict[str, Entry]) -> bool:
    """Whether ``found`` lists exactly ``entries`` (names in order, kinds, dtypes, shapes)."""
    return list(found) == list(entries) and all(
        (a.kind, a.dtype, a.shape) == (b.kind, b.dtype, b.shape)
        for a, b in zip(found.values(), entries.values(), strict=True)
    )


def store_index(md_path: Any, index: DCPIndex, key: dict[str, Any] | None) -> None:
    """Keep ``index``, built from the bytes ``key`` names, for the ``.metadata`` at ``md_path`` -- only
    while that is still the file they were read from; silently nothing when the cache cannot be written."""
    if key is not None and not IN_CHILD:
        _index_cache.store(md_path, key, index.to_bytes())


def index_from_bytes(data: bytes, label: str) -> DCPIndex:
    """The whole storage index of the ``.metadata`` bytes ``data``: the bulk parse when it takes the
    stream, the generic one otherwise (as :class:`~.checkpoint.DCPCheckpoint` parses it in-process)."""
    with gc_paused(), damage_named(label):
        found = fast_index(data, label)
        if found is not None:
            return found[0]
        md = load_light_metadata(data, label)
        return index_of(md, entries_from_metadata(md, label), label)


def open_fast(data: bytes, label: str, trust: bool) -> tuple[dict[str, Entry], Head | None, DCPIndex | None] | None:
    """A large ``.metadata`` opened by :mod:`.fast`: its entries with its head (the storage index
    parsed when first used), or -- in the child that parses it for a caller -- with its whole index.
    None when that parser does not take the stream (the generic parse then does)."""
    if trust or len(data) <= HEAD_ONLY_ABOVE:
        return None
    if IN_CHILD:
        found = fast_index(data, label)
        return None if found is None else (found[1], None, found[0])
    head = fast_head(data, label)
    return None if head is None else (dict(head.entries), head, None)


def full_after_head(data: bytes, label: str, head: Head) -> tuple[DCPIndex, dict[str, Entry]]:
    """The whole index of a ``.metadata`` opened from its :class:`~.fast.Head` (in this process),
    which must say what its head said."""
    found = fast_index(data, label)
    if found is None:  # the generic parse (which reports what is wrong, if anything)
        full = load_light_metadata(data, label)
        entries = entries_from_metadata(full, label)
        found = index_of(full, entries, label), entries
        dispose(full)
    check_head(head, found[1], found[0], label)
    return found


def index_of(md: Any, entries: dict[str, Entry], label: str) -> DCPIndex:
    """The storage index of whole light metadata records, whose ``entries`` are already read."""
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise CorruptCheckpointError(f"{label}: has no storage index")
    rows = [(e.fqn, e.dtype.name if e.dtype else None, e.shape) for e in entries.values()]
    return DCPIndex.from_metadata(md, rows)


def ambiguous(label: str) -> CorruptCheckpointError:
    """A stream whose head and whole list different entries: refused, not shown as either."""
    return CorruptCheckpointError(f"{label}: its entries are set twice, differently; refusing an ambiguous checkpoint")


def check_head(head: Head, entries: dict[str, Entry], index: DCPIndex, label: str) -> None:
    if not same_head(head, entries, index):
        raise ambiguous(label)


def check_stored(t: TensorRef, entry: Entry, c: Chunk, label: str) -> None:
    """A stored chunk holds what the metadata says it holds."""
    if t.dtype is not entry.dtype or t.shape != c.sizes:
        raise CorruptCheckpointError(
            f"{label}: the chunk stores {t.dtype} {list(t.shape)}; the metadata says {entry.dtype} {list(c.sizes)}"
        )


@contextlib.contextmanager
def damage_named(label: str) -> Iterator[None]:
    """Light metadata records hold whatever the pickle put in them: a missing or mistyped field
    means a damaged ``.metadata``, reported as such."""
    try:
        yield
    except (AttributeError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"{label}: damaged metadata ({type(e).__name__}: {e})") from e


def damaged_metadata(method: Any) -> Any:
    """:func:`damage_named` around a checkpoint's method."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with damage_named(str(self.path / METADATA_FILE)):
            return method(self, *args, **kwargs)

    return wrapper
