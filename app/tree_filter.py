"""Which entries of a checkpoint's tree to show, and what lies below each group (no Qt).

:class:`TreeIndex` is built once per checkpoint, on the worker that opens it: the entries in file
order, each node's parent, and the widest texts the tree's columns will show. :class:`EntryFilter`
matches entries by name (substring, or regular expression), dtype and shape;
:meth:`TreeIndex.select` applies one and totals the matches up the tree, touching only the matches
and their ancestors -- a 100,000-entry tree filters in tens of milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dcpstudio.core import Entry, Node
from dcpstudio.core.model import Totals, dtype_name

__all__ = ["Aggregate", "EntryFilter", "Selection", "TreeIndex", "human_count", "totals_by_kind", "value_type"]


def human_count(n: int) -> str:
    """``1,234`` below ten thousand, then ``12.3 K``, ``1.2 M``, ``7.24 B``."""
    if n < 10_000:
        return f"{n:,}"
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return str(n)


def value_type(entry: Entry) -> str:
    """What the Type column says of an entry: its dtype, or "value" (with the Python type when the
    format has it at hand) -- a number saved by DCP and by torch.save reads the same."""
    if entry.kind == "tensor":
        return dtype_name(entry.dtype) or "tensor"
    if entry.kind == "object" and entry.value is not None:
        return f"value ({type(entry.value).__name__})"
    return "value"


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
        if self.regex and self.text:
            pattern = re.compile(self.text, re.IGNORECASE)

            def name_ok(fqn: str) -> bool:
                return pattern.search(fqn) is not None
        else:
            needle = self.text.lower()

            def name_ok(fqn: str) -> bool:
                return needle in fqn.lower()

        shape_ok = _shape_predicate(self.shape)
        dtype = self.dtype

        def accept(e: Entry) -> bool:
            if dtype:
                if dtype == "value":
                    if e.kind == "tensor":
                        return False
                elif e.kind != "tensor" or dtype_name(e.dtype) != dtype:
                    return False
            if shape_ok is not None and (e.kind != "tensor" or not shape_ok(tuple(e.shape or ()))):
                return False
            return name_ok(e.fqn)

        return accept


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
    totals: dict[int, Aggregate] = field(default_factory=dict)  # visible nodes (matches and ancestors)


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
        stack = [root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                self.entries.append(node)
            for child in node.children.values():
                self.parent[id(child)] = node
                stack.append(child)
        self.entries.reverse()  # children were pushed in order and popped in reverse
        self.by_kind = totals_by_kind(self.entries)
        self.dtypes = sorted(k for k in self.by_kind if k != "value")
        self.has_values = "value" in self.by_kind
        self.sharded = False
        widest_dims: tuple[int, ...] = ()
        types: set[str] = set()
        for n in self.entries:  # one pass: what the columns show at their widest
            e = n.entry
            assert e is not None
            if e.kind == "tensor":
                shape = e.shape or ()
                if len(str(shape)) > len(str(widest_dims)):
                    widest_dims = shape
                if e.shard_of is not None or (chunk_count is not None and not self.sharded and chunk_count(e.fqn) > 1):
                    self.sharded = True
            else:
                types.add(value_type(e))
        self.widest_shape = "×".join(map(str, widest_dims)) or "scalar"
        self.widest_type = max([*types, *self.dtypes, f"{len(self.entries):,} entries"], key=len)

    def select(self, spec: EntryFilter) -> Selection:
        """Apply ``spec`` (raises ``re.error`` / ``ValueError`` for a bad pattern)."""
        accept = spec.compile()
        out = Selection()
        totals = out.totals
        parent = self.parent
        for node in self.entries:
            e = node.entry
            assert e is not None
            if not accept(e):
                continue
            out.matched.add(id(node))
            params, nbytes = (e.numel, e.nbytes) if e.kind == "tensor" else (0, 0)
            walk: Node | None = node
            while walk is not None:
                agg = totals.get(id(walk))
                if agg is None:
                    agg = totals[id(walk)] = Aggregate()
                agg.entries += 1
                agg.params += params
                agg.nbytes += nbytes
                walk = parent.get(id(walk))
        return out
