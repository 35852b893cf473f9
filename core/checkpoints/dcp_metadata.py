"""How a DCP checkpoint's ``.metadata`` becomes its entries and :class:`DCPIndex`: from the
restricted pickle (its head first when it is large), or -- for a large one already parsed
unchanged -- from the user's index cache (:mod:`dcpstudio.core._index_cache`), with no pickle
read at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import _index_cache
from .._pickle import gc_paused
from ..dtypes import dtype_of
from ..errors import CorruptCheckpointError
from ..formats.dcp_index import DCPIndex, small_ints
from ..model import Entry

__all__ = [
    "CACHE_ABOVE",
    "HEAD_ONLY_ABOVE",
    "byte_size",
    "cache_wanted",
    "cached_index",
    "dispose",
    "entries_from_index",
    "entries_from_metadata",
    "same_metadata",
    "store_index",
]

HEAD_ONLY_ABOVE = 4 << 20  # .metadata sizes past which the storage index is parsed lazily
CACHE_ABOVE = HEAD_ONLY_ABOVE  # .metadata sizes whose index is kept in the user's cache
_CACHE_KIND = "dcp-metadata"


def cache_wanted(md_path: Path) -> bool:
    try:
        return md_path.stat().st_size > CACHE_ABOVE
    except OSError:
        return False


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
    for k, name in enumerate(index.names):
        d = kinds[k]
        if d < 0:
            entries[name] = Entry(name, "bytes", byte_size=byte_size(index, name))
        else:
            entries[name] = Entry(name, "tensor", dtypes[d], tuple(dims[starts[k] : starts[k + 1]]))
    if len(entries) != len(index.names):
        raise ValueError("an entry is listed twice")
    return entries


def cached_index(md_path: Path) -> tuple[DCPIndex, dict[str, Entry]] | None:
    found = _index_cache.load(md_path, _CACHE_KIND)
    if found is None:
        return None
    try:
        with gc_paused():
            index = DCPIndex.from_bytes(found[1])
            entries = entries_from_index(index)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError):
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


def store_index(md_path: Path, index: DCPIndex) -> None:
    """Keep ``index`` for the ``.metadata`` at ``md_path`` as it is now (large ones only; silently
    nothing when the cache cannot be written)."""
    if cache_wanted(md_path):
        _index_cache.store(md_path, _CACHE_KIND, index.to_bytes())
