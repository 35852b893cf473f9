"""The entries and storage index of a large DCP ``.metadata`` with no Python object per chunk: the
same :class:`~.dcp_index.DCPIndex` (and entries) the restricted unpickler and
:meth:`DCPIndex.from_metadata` would give, or None -- the caller then takes that slower path.

torch's pickler writes every entry of ``state_dict_metadata`` (with its chunk records) and every item
of ``storage_data`` with the same opcodes -- classes, dict keys and ``torch.Size`` as memo
references -- only names and integers differing. Those records are nearly all of a large
``.metadata``, and unpickling them one object at a time is what makes it slow. Here:

1. The records' byte patterns are learnt from the stream's own first records written with
   references; *runs* of consecutive records are found and taken apart by regular expressions, in C.
   Names and integers come out as bytes, decoded once per distinct value.
2. Each run is cut out and replaced by as many memo stores as it made (of a placeholder) and a
   persistent id carrying a random nonce. The remainder -- the first records, odd entries, planner
   data -- is scanned and unpickled by the usual restricted unpickler, which also resolves every memo
   reference the runs used (appended as probes at the end of the stream).
3. That is the real parse only if each run is executed by the unpickler as the opcodes its pattern
   describes. The runs are found by a search over raw bytes, which also finds record-shaped bytes
   inside an argument (a ``BINBYTES`` whose length covers them) or across a protocol-4 frame's end; so
   one walk of the stream's opcodes (:func:`~...pickles.guard.lands_on`) must land on every run's first
   and last byte and on every frame start, and a pattern is made of whole opcodes only. Then: every id
   (runs, and one at each frame boundary) must load exactly once, where a run belongs; no placeholder
   or run may stay reachable from the result; the stream may store its memo only by MEMOIZE (appends:
   an index names the same object at the end as where a run used it); every probe must be what the
   records need (``'offsets'``, the ``ChunkStorageMetadata`` class, a dtype, ...); names must be as
   long as their length bytes say. Anything else: None.
"""

from __future__ import annotations

import re
import struct
from array import array
from collections.abc import Sequence
from itertools import chain, repeat
from operator import add, itemgetter, methodcaller
from typing import Any

from ...dtypes import DType
from ...formats.dcp.index import DCPIndex
from ...pickles.unpicklers import gc_paused
from ..model import Entry
from .fast_cut import INT, PLANNER_KEY, Cut, NotFast, RunToken, learn, unframed, unpickled

__all__ = ["Head", "fast_head", "fast_index", "same_head"]

_I4 = struct.Struct("<i")
_ENTRY: Any = Entry  # mapped over columns
_SECOND: Any = itemgetter(1)
_THIRD: Any = itemgetter(2)
_ONE_INT = re.compile(INT)
_PLANS = b"all_local_plans"  # Metadata.all_local_plans (see ...pickles.plan_records)


def _int(raw: bytes) -> int:
    op = raw[0]
    if op == 0x4B:  # K
        return raw[1]
    if op == 0x4D:  # M
        return raw[1] | raw[2] << 8
    if op == 0x4A:  # J
        return int(_I4.unpack_from(raw, 1)[0])
    return int.from_bytes(raw[2:], "little", signed=True)  # LONG1


def _ints(raw: bytes) -> tuple[int, ...]:
    """The integers of a pickled tuple (TUPLE1-3 or MARK ... TUPLE, then MEMOIZE; or EMPTY_TUPLE)."""
    return tuple(_int(m.group()) for m in _ONE_INT.finditer(raw, 1 if raw[:1] == b"(" else 0, len(raw) - 2))


def _decoded(groups: Sequence[bytes], cache: dict[bytes, Any], fn: Any) -> list[Any]:
    """``fn`` of each of ``groups``, computed once per distinct value (tuples repeat across chunks)."""
    out = list(map(cache.get, groups))
    if None in out:
        for raw in set(groups).difference(cache):
            cache[raw] = fn(raw)
        out = list(map(cache.__getitem__, groups))
    return out


_PAD4 = methodcaller("ljust", 4, b"\0")
_DECODE = methodcaller("decode", "utf-8", "surrogatepass")  # as the unpickler decodes a name


def _int_column(k: Sequence[bytes], m: Sequence[bytes], j: Sequence[bytes], long1: Sequence[bytes]) -> list[int]:
    """Integers captured as (BININT1, BININT2, BININT argument; LONG1 opcode with its arguments), one
    of the four set per row: each row's argument padded to a little-endian int32, all read at once."""
    raw = b"".join(map(_PAD4, map(add, map(add, k, m), j)))
    out = array("i")
    out.frombytes(raw)
    values = out.tolist()
    if any(long1):  # those rows read 0 above
        values = [v + (_int(b) if b else 0) for v, b in zip(values, long1, strict=True)]
    return values


def _names(lengths: Sequence[bytes], texts: Sequence[bytes]) -> list[str]:
    """Names written in place (SHORT_BINUNICODE): each must be as long as its length byte says."""
    if list(map(len, texts)) != list(b"".join(lengths)):
        raise NotFast
    return list(map(_DECODE, texts))


def _text(length: bytes, raw: bytes) -> str:
    if len(raw) != length[0]:
        raise NotFast
    return raw.decode("utf-8", "surrogatepass")


def fast_index(data: bytes, label: str) -> tuple[DCPIndex, dict[str, Entry]] | None:
    """``(index, entries)`` of the ``.metadata`` bytes ``data``, or None when the stream is not one this
    parser reads exactly as the unpickler would (the caller parses it the generic way, and reports
    what is wrong with it)."""
    if _PLANS in data:  # Megatron's save plans refer to the records the runs would cut: never taken
        return None
    found = unframed(data)
    if found is None or not found[0].endswith(b"."):
        return None
    s, frame_starts = found
    pats = learn(s)
    if pats is None:
        return None
    with gc_paused():
        try:
            return _parse(s, frame_starts, label, pats)
        except Exception:  # hands the stream to the generic parse, which reports what is wrong (or reads
            return None  # it, were this one mistaken): a fast path never makes a checkpoint fail to open


def _parse(s: bytes, frame_starts: list[int], label: str, pats: Any) -> Any:
    cut = Cut(s, frame_starts, pats)
    md, resolved = unpickled(cut, label)
    built = _Builder(md, cut, resolved).build()
    if any(t.seen != 2 for t in cut.tokens):  # each run stood where its records belong
        raise NotFast
    return built


class Head:
    """What a ``.metadata``'s head -- the stream up to its planner data -- says: its entries and each
    tensor's chunk count (None: unknown until its chunk list is read)."""

    def __init__(self, entries: dict[str, Entry], counts: dict[str, int | None]) -> None:
        self.entries, self.counts = entries, counts


def fast_head(data: bytes, label: str) -> Head | None:
    """The entries of a ``.metadata`` and their chunk counts, parsing only the stream before its
    planner data and storage index, with no object per chunk -- or None (the caller parses the generic
    way). The whole stream must later say the same: see :func:`same_head`."""
    found = unframed(data, PLANNER_KEY)
    if found is None:
        return None
    s, frame_starts = found
    pats = learn(s, ("chunk", "entry"))
    if pats is None:
        return None
    head = s + b"ub."  # the Metadata's fields so far set (SETITEMS), built (BUILD); STOP
    with gc_paused():
        try:
            cut = Cut(head, [f for f in frame_starts if f < len(s)], pats)
            cut.head_only = True
            md, resolved = unpickled(cut, label)
            return _Builder(md, cut, resolved).head()
        except Exception:  # as in fast_index
            return None


def same_head(head: Head, entries: dict[str, Entry], index: DCPIndex) -> bool:
    """Whether the whole stream (``entries`` and ``index`` parsed from it) says what its head said."""
    if list(entries) != list(head.entries) or any(
        (a.kind, a.dtype, a.shape) != (b.kind, b.dtype, b.shape)
        for a, b in zip(head.entries.values(), entries.values(), strict=True)
    ):
        return False
    counts = [b - a for a, b in zip(index.chunk_start, index.chunk_start[1:], strict=False)]
    for k in index.errors:  # an entry whose chunks could not be indexed lists none: not a difference
        counts[k] = -1
    return not any(n is not None and c >= 0 and n != c for n, c in zip(head.counts.values(), counts, strict=True))


class _Chunk:
    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self.offsets, self.sizes = offsets, sizes


class _Info:
    __slots__ = ("length", "offset", "relative_path")
    transform_descriptors = None

    def __init__(self, row: tuple[str, int, int]) -> None:
        self.relative_path, self.offset, self.length = row


class _Builder:
    """The entries and index, as :func:`entries_from_metadata` and :meth:`DCPIndex.from_metadata` make
    them from the records the runs stand for -- runs in bulk, the remainder's records one by one."""

    def __init__(self, md: Any, cut: Cut, resolved: dict[bytes, Any]) -> None:
        self.md, self.cut, self.resolved = md, cut, resolved
        self.tuples: dict[bytes, tuple[int, ...]] = {}
        self.ints: dict[bytes, int] = {}
        self.where: dict[tuple[str, Any], Any] = {}
        self.entries: dict[str, Entry] = {}
        self.index = DCPIndex()

    def build(self) -> tuple[DCPIndex, dict[str, Entry]]:
        sdm, storage = getattr(self.md, "state_dict_metadata", None), getattr(self.md, "storage_data", None)
        if type(sdm) is not dict or type(storage) is not dict:
            raise NotFast
        for key, info in storage.items():
            if type(key) is RunToken:
                self._items(key, info)
                continue
            fqn, offset = key.fqn, getattr(key, "offset", None)
            if type(fqn) is not str or (offset is not None and type(offset) is not tuple) or type(info) is RunToken:
                raise NotFast
            self.where[(fqn, offset)] = info  # None (a byte item's key) is not () (a 0-d tensor's)
        for fqn, smd in sdm.items():
            if type(fqn) is RunToken:
                self._entries(fqn, smd)
            elif type(fqn) is not str or type(smd) is RunToken:
                raise NotFast
            else:
                self._one(fqn, smd)
        if len(self.entries) != len(self.index.names):  # a name twice: its dict would have kept one
            raise NotFast
        self.index.finish(self.md)
        return self.index, self.entries

    def head(self) -> Head:
        sdm = getattr(self.md, "state_dict_metadata", None)
        if type(sdm) is not dict:
            raise NotFast
        counts: dict[str, int | None] = {}
        for fqn, smd in sdm.items():
            if type(fqn) is RunToken:
                groups, n = self._run(fqn, smd, "entry")[:2]
                counts.update(zip(self._run_entries(groups)[0], n, strict=True))
            elif type(fqn) is not str or type(smd) is RunToken:
                raise NotFast
            else:
                entry = self.entries[fqn] = _entry(fqn, smd)
                listed = smd.chunks if entry.kind == "tensor" else [None]
                counts[fqn] = len(listed) if isinstance(listed, (list, tuple)) else None
        if len(self.entries) != len(counts) or any(t.seen != 2 for t in self.cut.tokens):
            raise NotFast
        return Head(self.entries, counts)

    def _run(self, token: RunToken, value: Any, kind: str) -> Any:
        found_kind, held = self.cut.runs[token.k]
        if value is not None or found_kind != kind or token.seen != 1:
            raise NotFast
        token.seen = 2
        return held

    def _items(self, token: RunToken, value: Any) -> None:
        groups = self._run(token, value, "item")
        resolved = self.resolved
        columns = list(zip(*groups, strict=True))
        if all(columns[0]):  # every name a reference (one process's save)
            fqns = list(map(resolved.__getitem__, columns[0]))
        elif not any(columns[0]):  # every name in place (gathered from many ranks)
            fqns = _names(columns[1], columns[2])
        else:
            fqns = [resolved[g[0]] if g[0] else _text(g[1], g[2]) for g in groups]
        offsets = _decoded(columns[4], self.tuples, _ints)
        rows = zip(  # noqa: B905  # three columns of one length
            list(map(resolved.__getitem__, columns[5])),
            _int_column(*columns[6:10]),
            _int_column(*columns[10:14]),
        )
        self.where.update(zip(zip(fqns, offsets, strict=True), rows, strict=True))

    def _stored(self, name: str) -> Any:
        where = self.where

        def stored(offsets: Any) -> Any:
            found = where.get((name, offsets))
            return _Info(found) if type(found) is tuple else found

        return stored

    def _one(self, fqn: str, smd: Any) -> None:
        """An entry from the remainder, as the generic parse takes it."""
        entry = self.entries[fqn] = _entry(fqn, smd)
        dtype = entry.dtype.name if entry.dtype else None
        self.index.add(fqn, dtype, entry.shape, [None] if dtype is None else (lambda: smd.chunks), self._stored(fqn))

    def _run_entries(self, groups: list[Any]) -> tuple[list[str], list[DType], list[tuple[int, ...]]]:
        """The names, dtypes and shapes of a run's entries, added to the entries."""
        names = _names([g[0] for g in groups], [g[1] for g in groups])
        dtypes = [self.resolved[g[2]] for g in groups]
        shapes = _decoded([g[5] for g in groups], self.tuples, _ints)
        for shape in set(shapes):
            _shape(shape)
        self.entries.update(zip(names, map(_ENTRY, names, repeat("tensor"), dtypes, shapes), strict=True))
        return names, dtypes, shapes

    def _entries(self, token: RunToken, value: Any) -> None:
        groups, counts, offs_raw, sizes_raw = self._run(token, value, "entry")
        names, dtypes, shapes = self._run_entries(groups)
        offsets = _decoded(offs_raw, self.tuples, _ints)
        sizes = _decoded(sizes_raw, self.tuples, _ints)
        chunk_names = list(chain.from_iterable(map(repeat, names, counts)))
        rows: list[Any] = list(map(self.where.get, zip(chunk_names, offsets, strict=True)))
        distinct = set(offsets) | set(sizes)
        plain = (
            _dims_match(distinct, shapes, counts, offsets, sizes)
            and set(map(type, rows)) <= {tuple}
            and min(chain.from_iterable(distinct), default=0) >= 0
            and min(map(_SECOND, rows), default=0) >= 0
            and min(map(_THIRD, rows), default=0) >= 0
        )
        if plain:
            self.index.add_many(names, [d.name for d in dtypes], shapes, counts, offsets, sizes, rows)
            return
        at = 0
        for name, dtype, shape, n in zip(names, dtypes, shapes, counts, strict=True):  # one by one: the same errors
            listed = list(map(_Chunk, offsets[at : at + n], sizes[at : at + n]))
            at += n
            self.index.add(name, dtype.name, shape, listed, self._stored(name))


def _dims_match(distinct: set[Any], shapes: list[tuple[int, ...]], counts: list[int], *columns: Any) -> bool:
    """Whether every chunk's offsets and sizes have its tensor's number of dimensions."""
    if len(set(map(len, distinct)) | set(map(len, shapes))) <= 1:  # all the same: no need to look closer
        return True
    ndims = list(chain.from_iterable(map(repeat, map(len, shapes), counts)))
    return all(list(map(len, column)) == ndims for column in columns)


def _entry(fqn: str, smd: Any) -> Entry:
    """The entry a record of the remainder describes (NotFast where the generic parse would refuse it)."""
    if hasattr(smd, "chunks"):
        return Entry(fqn, "tensor", _dtype(smd.properties.dtype), _shape(smd.size))
    return Entry(fqn, "bytes")


def _dtype(value: Any) -> DType:
    if not isinstance(value, DType):
        raise NotFast
    return value


def _shape(value: Any) -> tuple[int, ...]:
    if type(value) is not tuple or len(value) > 64 or not all(type(v) is int and v >= 0 for v in value):
        raise NotFast  # the generic parse refuses it, with its message
    return value
