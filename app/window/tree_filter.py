"""Which entries of a checkpoint's tree to show, and what lies below each group (no Qt).

:class:`TreeIndex` is built once per checkpoint, on the worker that opens it: the entries in file
order, each node's parent, and the widest texts the tree's columns will show. :class:`EntryFilter`
matches entries by name (substring, or regular expression), dtype and shape;
:meth:`TreeIndex.select` applies one and totals the matches up the tree, touching only the matches
and their ancestors -- a 100,000-entry tree filters in tens of milliseconds.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dcpstudio.core import Entry, Node
from dcpstudio.core.checkpoints.model import Totals, dtype_name

from .kinds import value_type

__all__ = ["Aggregate", "EntryFilter", "Selection", "TreeIndex", "totals_by_kind"]


@dataclass
class Aggregate:
    """What lies below a node: entries, tensor elements (parameters) and tensor bytes."""

    entries: int = 0
    params: int = 0
    nbytes: int = 0


_SHAPE_SPLIT = re.compile(r"[x×,\s]+")


@dataclass(frozen=True)
class EntryFilter:
    """Which entries to show. ``text``: searched in the full name (a substring, case-insensitive,
    or a regular expression with ``regex``). ``dtype``: a dtype name, or "value" for non-tensor
    entries. ``shape``: "4096" (any dimension is 4096), "4096x*" (two dimensions, the first 4096),
    "[*, 128]", or "scalar"."""

    text: str = ""
    regex: bool = False
    dtype: str = ""
    shape: str = ""

    @property
    def active(self) -> bool:
        return bool(self.text or self.dtype or self.shape.strip())

    def compile(self) -> Callable[[Entry], bool]:
        """A predicate over entries; raises ``re.error`` / ``ValueError`` for a bad pattern."""
        name_ok, kind_ok = self.compile_parts()

        regex = self.regex

        def accept(e: Entry) -> bool:
            if kind_ok is not None and not kind_ok(e):
                return False
            return name_ok is None or name_ok(e.fqn if regex else e.fqn.lower())

        return accept

    def compile_parts(self) -> tuple[Callable[[str], bool] | None, Callable[[Entry], bool] | None]:
        """The predicate over names (given lower-cased unless ``regex``) and the one over kind,
        dtype and shape -- which entries of one dtype and shape share, so it runs once per such
        group; None for a part that accepts everything."""
        name_ok: Callable[[str], bool] | None = None
        if self.regex and self.text:
            pattern = re.compile(self.text, re.IGNORECASE)

            def search(fqn: str) -> bool:
                return pattern.search(fqn) is not None

            name_ok = search
        elif self.text:
            needle = self.text.lower()

            def contains(lowered: str) -> bool:
                return needle in lowered

            name_ok = contains
        shape_ok = _shape_predicate(self.shape)
        dtype = self.dtype
        if not dtype and shape_ok is None:
            return name_ok, None

        def kind_ok(e: Entry) -> bool:
            if dtype:
                if dtype == "value":
                    if e.kind == "tensor":
                        return False
                elif e.kind != "tensor" or dtype_name(e.dtype) != dtype:
                    return False
            return shape_ok is None or (e.kind == "tensor" and shape_ok(tuple(e.shape or ())))

        return name_ok, kind_ok


def _shape_predicate(text: str) -> Callable[[tuple[int, ...]], bool] | None:
    text = text.strip().strip("[]()").strip()
    if not text:
        return None
    if text.lower() == "scalar":
        return lambda shape: shape == ()
    parts = [p for p in _SHAPE_SPLIT.split(text) if p]
    for p in parts:
        if p != "*" and not p.isdigit():
            raise ValueError(f"shape pattern: {p!r} is neither a number nor *")
    if len(parts) == 1 and parts[0] != "*" and not re.search(r"[x×,]", text):
        size = int(parts[0])
        return lambda shape: size in shape
    want = [None if p == "*" else int(p) for p in parts]
    return lambda shape: len(shape) == len(want) and all(w is None or w == s for w, s in zip(want, shape, strict=True))


@dataclass
class Selection:
    """The outcome of a filter: matching entry nodes, every node that leads to one, their totals."""

    matched: set[int] = field(default_factory=set)
    totals: Mapping[int, Aggregate] = field(default_factory=dict)  # visible nodes (matches and ancestors)


_FLIP = bytes([1, 0] + [0] * 254)


class _ByGet(Mapping[int, Aggregate]):
    """A mapping whose lookups all go through ``get`` (which computes the value, or gives None)."""

    def get(self, key: int, default: Any = None) -> Any:
        raise NotImplementedError

    def __getitem__(self, key: int) -> Aggregate:
        found: Aggregate | None = self.get(key)
        if found is None:
            raise KeyError(key)
        return found


class _Sums(_ByGet):
    """Totals over entries at each node leading to one, from per-size-group counts of entries below
    each node (an :class:`Aggregate` is made only for a node that is asked for: the shown rows)."""

    def __init__(self, counted: list[tuple[Counter[int], int, int]]) -> None:
        self._counted = counted

    def get(self, key: int, default: Any = None) -> Any:
        agg = Aggregate()
        for counts, params, nbytes in self._counted:
            n = counts.get(key, 0)
            agg.entries += n
            agg.params += n * params
            agg.nbytes += n * nbytes
        return agg if agg.entries else default

    def __contains__(self, key: object) -> bool:
        return any(key in counts for counts, _, _ in self._counted)

    def __iter__(self) -> Iterator[int]:
        return iter({k for counts, _, _ in self._counted for k in counts})

    def __len__(self) -> int:
        return len({k for counts, _, _ in self._counted for k in counts})


class _AllBut(_ByGet):
    """The totals of a selection that keeps most entries: each node's own totals less those of the
    entries left out (computed for the few left out, not the many kept)."""

    def __init__(self, nodes: dict[int, Node], left_out: Mapping[int, Aggregate]) -> None:
        self._nodes = nodes
        self._left_out = left_out

    def get(self, key: int, default: Any = None) -> Any:
        node = self._nodes.get(key)
        if node is None:
            return default
        t, out = node.totals, self._left_out.get(key)
        if out is None:
            return Aggregate(t.count, t.params, t.tensor_bytes)
        if t.count == out.entries:
            return default
        return Aggregate(t.count - out.entries, t.params - out.params, t.tensor_bytes - out.nbytes)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.get(key) is not None

    def __iter__(self) -> Iterator[int]:
        return (k for k in self._nodes if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def totals_by_kind(nodes: Iterable[Node]) -> dict[str, Totals]:
    """Totals by dtype of the entries at ``nodes``, non-tensor values together as "value" (DCP's
    pickled "bytes" and torch.save's "object" alike)."""
    out: dict[str, Totals] = {}
    for n in nodes:
        e = n.entry
        if e is not None:
            key = (dtype_name(e.dtype) or "tensor") if e.kind == "tensor" else "value"
            out.setdefault(key, Totals()).add_entry(e)
    return out


class TreeIndex:
    """Entries, parents and column texts of one tree, computed once (on a worker)."""

    def __init__(self, root: Node, chunk_count: Callable[[str], int] | None = None) -> None:
        self.root = root
        self.entries: list[Node] = []
        self.parent: dict[int, Node] = {}
        self.nodes: dict[int, Node] = {id(root): root}
        ancestry: dict[int, tuple[int, ...]] = {id(root): (id(root),)}  # a node and those above it
        stack = [root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                self.entries.append(node)
            above = ancestry[id(node)]
            for child in node.children.values():
                self.parent[id(child)] = node
                self.nodes[id(child)] = child
                ancestry[id(child)] = (id(child), *above)
                stack.append(child)
        self.entries.reverse()  # children were pushed in order and popped in reverse
        # what filtering reads, prepared here (on the opening worker) so that a filter answers at once
        self._ids = [id(n) for n in self.entries]
        self._ancestry = list(map(ancestry.__getitem__, self._ids))
        self._names = [n.entry.fqn for n in self.entries if n.entry is not None]
        self._lowered = [name.lower() for name in self._names]
        groups: dict[tuple[str, Any, tuple[int, ...] | None], int] = {}  # kind, dtype, shape -> group
        self._group_of: list[int] = []
        self._members: list[list[int]] = []
        types: set[str] = set()
        for k, n in enumerate(self.entries):
            e = n.entry
            assert e is not None
            key = (e.kind, e.dtype, e.shape)
            g = groups.get(key)
            if g is None:
                g = groups[key] = len(self._members)
                self._members.append([])
            self._members[g].append(k)
            self._group_of.append(g)
            if e.kind != "tensor":
                types.add(value_type(e))
        self._first = [self.entries[ks[0]].entry for ks in self._members]  # each group's first entry
        self._size = [(e.numel, e.nbytes) if e is not None and e.kind == "tensor" else (0, 0) for e in self._first]
        self.by_kind = totals_by_kind(self.entries)
        self.dtypes = sorted(k for k in self.by_kind if k != "value")
        self.has_values = "value" in self.by_kind
        self.sharded = any(n.entry is not None and n.entry.shard_of is not None for n in self.entries)
        if chunk_count is not None and not self.sharded:
            self.sharded = any(
                n.entry.kind == "tensor" and chunk_count(n.entry.fqn) > 1 for n in self.entries if n.entry
            )
        shapes = [e.shape or () for e in self._first if e is not None and e.kind == "tensor"]
        widest_dims = max(shapes, key=lambda shape: len(str(shape)), default=())
        self.widest_shape = "×".join(map(str, widest_dims)) or "scalar"
        self.widest_type = max([*types, *self.dtypes, f"{len(self.entries):,} entries"], key=len)

    def select(self, spec: EntryFilter) -> Selection:
        """Apply ``spec`` (raises ``re.error`` / ``ValueError`` for a bad pattern). The dtype and
        shape test runs once per group of entries that share them; totals are summed over the
        matches, or -- when most entries match -- over the rest and taken off each node's totals."""
        name_ok, kind_ok = spec.compile_parts()
        chosen: list[int] | range = range(len(self.entries))
        if kind_ok is not None:
            chosen = [k for e, ks in zip(self._first, self._members, strict=True) if kind_ok(e) for k in ks]
        if name_ok is not None and not spec.regex:
            needle, lowered = spec.text.lower(), self._lowered  # the commonest filter, inlined
            if isinstance(chosen, range):
                chosen = [k for k, name in enumerate(lowered) if needle in name]
            else:
                chosen = [k for k in chosen if needle in lowered[k]]
        elif name_ok is not None:
            chosen = [k for k in chosen if name_ok(self._names[k])]
        out = Selection(set(map(self._ids.__getitem__, chosen)))
        if 2 * len(chosen) <= len(self.entries):
            out.totals = self._sum(chosen)
        else:
            keep = bytearray(len(self.entries))
            for k in chosen:
                keep[k] = 1
            out.totals = _AllBut(
                self.nodes, self._sum(list(itertools.compress(range(len(keep)), keep.translate(_FLIP))))
            )
        return out

    def _sum(self, chosen: Iterable[int]) -> _Sums:
        """Totals of the entries at positions ``chosen``, at each node that leads to one: counted
        per group of entries of equal size (one C-level count over their ancestries each)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for k in chosen:
            e = self.entries[k].entry
            assert e is not None
            groups.setdefault((e.numel, e.nbytes) if e.kind == "tensor" else (0, 0), []).append(k)
        ancestry = self._ancestry
        counted = [
            (Counter(itertools.chain.from_iterable(map(ancestry.__getitem__, ks))), p, b)
            for (p, b), ks in groups.items()
        ]
        return _Sums(counted)
