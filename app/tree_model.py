"""The metadata tree of an open checkpoint as a Qt item model, populated lazily.

A thin adapter over :class:`dcpstudio.core.Node`: children are exposed in batches through
``canFetchMore`` / ``fetchMore`` so a 100,000-entry checkpoint never creates all its rows at once.
Groups show how many entries, parameters (elements) and tensor bytes lie below them.
:class:`EntryFilterProxy` filters by name (substring or regular expression), dtype and shape: a
group stays visible when anything below it matches, matching entries are highlighted, and group
totals count the matches only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QAbstractItemModel, QModelIndex, QPersistentModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QBrush, QColor, QFont

from dcpstudio.core import Entry, Node
from dcpstudio.core.model import dtype_name, printable
from dcpstudio.core.report import human_bytes

from .proxies import change_filter

__all__ = [
    "COLUMNS",
    "NODE_ROLE",
    "SORT_ROLE",
    "Aggregate",
    "CheckpointTreeModel",
    "EntryFilter",
    "EntryFilterProxy",
    "human_count",
    "value_type",
]

COLUMNS = ("Name", "Type", "Shape", "Params", "Size", "Chunks")
NAME, TYPE, SHAPE, PARAMS, SIZE, CHUNKS = range(len(COLUMNS))
NODE_ROLE = Qt.ItemDataRole.UserRole + 1
SORT_ROLE = Qt.ItemDataRole.UserRole + 2
_BATCH = 500
AnyIndex = QModelIndex | QPersistentModelIndex


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

    def add_entry(self, e: Entry) -> None:
        self.entries += 1
        if e.kind == "tensor":
            self.params += e.numel
            self.nbytes += e.nbytes

    def add(self, other: Aggregate) -> None:
        self.entries += other.entries
        self.params += other.params
        self.nbytes += other.nbytes


def aggregate(root: Node, keep: set[int] | None = None) -> dict[int, Aggregate]:
    """Totals for every node below ``root`` (by ``id``), over all entries or those in ``keep``."""
    out: dict[int, Aggregate] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order: trees may be deeper than Python's recursion limit
        node, done = stack.pop()
        if not done:
            stack.append((node, True))
            stack.extend((child, False) for child in node.children.values())
            continue
        agg = Aggregate()
        if node.entry is not None and (keep is None or id(node) in keep):
            agg.add_entry(node.entry)
        for child in node.children.values():
            sub = out.get(id(child))
            if sub is not None:
                agg.add(sub)
        out[id(node)] = agg
    return out


class CheckpointTreeModel(QAbstractItemModel):
    """Rows are tree nodes; ``chunk_count(fqn)`` supplies the Chunks column (may be None)."""

    def __init__(self, root: Node, chunk_count: Any = None, parent: Any = None) -> None:
        super().__init__(parent)
        self._root = root
        self._chunk_count = chunk_count
        self._children: dict[int, list[Node]] = {}
        self._fetched: dict[int, int] = {}
        self._parents: dict[int, Node] = {}
        self._rows: dict[int, int] = {}
        self.totals = aggregate(root)

    # -- tree plumbing ----------------------------------------------------------------------------
    def node(self, index: AnyIndex) -> Node:
        return index.internalPointer() if index.isValid() else self._root

    def _kids(self, node: Node) -> list[Node]:
        kids = self._children.get(id(node))
        if kids is None:
            kids = self._children[id(node)] = list(node.children.values())
            for row, kid in enumerate(kids):
                self._parents[id(kid)] = node
                self._rows[id(kid)] = row
        return kids

    def index(self, row: int, column: int, parent: AnyIndex = QModelIndex()) -> QModelIndex:  # noqa: B008
        if not self.hasIndex(row, column, parent):
            return QModelIndex()
        return self.createIndex(row, column, self._kids(self.node(parent))[row])

    def parent(self, index: AnyIndex = QModelIndex()) -> QModelIndex:  # type: ignore[override]  # noqa: B008
        if not index.isValid():
            return QModelIndex()
        parent = self._parents.get(id(index.internalPointer()))
        if parent is None or parent is self._root:
            return QModelIndex()
        return self.createIndex(self._rows[id(parent)], 0, parent)

    def rowCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        if parent.isValid() and parent.column() != 0:
            return 0
        return self._fetched.get(id(self.node(parent)), 0)

    def columnCount(self, parent: AnyIndex = QModelIndex()) -> int:  # noqa: B008
        return len(COLUMNS)

    def hasChildren(self, parent: AnyIndex = QModelIndex()) -> bool:  # noqa: B008
        if parent.isValid() and parent.column() != 0:
            return False
        return bool(self.node(parent).children)

    def canFetchMore(self, parent: AnyIndex) -> bool:
        if parent.isValid() and parent.column() != 0:
            return False
        node = self.node(parent)
        return self._fetched.get(id(node), 0) < len(node.children)

    def fetchMore(self, parent: AnyIndex) -> None:
        node = self.node(parent)
        kids = self._kids(node)
        have = self._fetched.get(id(node), 0)
        more = min(_BATCH, len(kids) - have)
        if more <= 0:
            return
        self.beginInsertRows(parent, have, have + more - 1)
        self._fetched[id(node)] = have + more
        self.endInsertRows()

    def index_of(self, path: str) -> QModelIndex:
        """The index of the node at ``path`` (a dotted name), fetching its ancestors' rows."""
        parent = QModelIndex()
        node = self._root
        parts = path.split(".") if path else []
        for depth in range(len(parts)):
            child = node.children.get(parts[depth])
            if child is None:  # a segment that itself holds dots ("a.b" under a flat name): search by path
                want = ".".join(parts[: depth + 1])
                child = next((c for c in node.children.values() if c.path == want), None)
                if child is None:
                    continue
            self._kids(node)
            row = self._rows[id(child)]
            while self._fetched.get(id(node), 0) <= row:
                self.fetchMore(parent)
            parent, node = self.index(row, 0, parent), child
        return parent if node is not self._root else QModelIndex()

    # -- data -------------------------------------------------------------------------------------
    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.ToolTipRole:
            return {
                PARAMS: "Elements (parameters) of the tensor, or of every tensor below a group",
                SIZE: "Tensor bytes, of the entry or of every tensor below a group",
                CHUNKS: "How many pieces the tensor is stored in",
            }.get(section)
        return None

    def cell(self, node: Node, col: int, agg: Aggregate) -> Any:
        """The display text of ``node`` in column ``col``, with ``agg`` as its totals."""
        e = node.entry
        if col == NAME:
            return printable(node.name)
        group = e is None or bool(node.children)
        if col == PARAMS:
            return human_count(agg.params) if (group or (e is not None and e.kind == "tensor")) else None
        if col == SIZE:
            return human_bytes(agg.nbytes) if (group or (e is not None and e.kind == "tensor")) else None
        if e is None:
            return (f"{agg.entries:,} entries" if agg.entries != 1 else "1 entry") if col == TYPE else None
        if col == TYPE:
            return value_type(e)
        if col == SHAPE:
            return "×".join(map(str, e.shape)) if e.shape else ("scalar" if e.kind == "tensor" else None)
        if col == CHUNKS and e.kind == "tensor" and self._chunk_count is not None:
            return self._chunk_count(e.fqn)
        return None

    def sort_key(self, node: Node, col: int, agg: Aggregate) -> Any:
        if col == SIZE:
            return agg.nbytes
        if col == PARAMS:
            return agg.params
        if col == SHAPE and node.entry is not None:
            return node.entry.numel
        if col == CHUNKS:
            value = self.cell(node, col, agg)
            return value if isinstance(value, int) else -1
        return str(self.cell(node, col, agg) or "")

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        node: Node = index.internalPointer()
        if role == NODE_ROLE:
            return node
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self.cell(node, col, self.totals[id(node)])
        if role == SORT_ROLE:
            return self.sort_key(node, col, self.totals[id(node)])
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == PARAMS:
                return f"{self.totals[id(node)].params:,} elements"
            if col == SIZE:
                return f"{self.totals[id(node)].nbytes:,} bytes"
            return printable(node.path)
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (PARAMS, SIZE, CHUNKS):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def flags(self, index: AnyIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable


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

    def compile(self) -> Any:
        """A predicate over entries; raises ``re.error`` / ``ValueError`` for a bad pattern."""
        if self.regex and self.text:
            pattern = re.compile(self.text, re.IGNORECASE)
            name_ok: Any = lambda fqn: pattern.search(fqn) is not None  # noqa: E731
        else:
            needle = self.text.lower()
            name_ok = lambda fqn: needle in fqn.lower()  # noqa: E731
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


def _shape_predicate(text: str) -> Any:
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


class EntryFilterProxy(QSortFilterProxyModel):
    """Shows matching entries and the groups above them; matches are bold; group totals count
    matches only. :attr:`matched` / :attr:`total` are the entry counts behind "n of N"."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._visible: set[int] | None = None
        self._matched_ids: set[int] = set()
        self._totals: dict[int, Aggregate] = {}
        self.matched = 0
        self.total = 0
        self.setSortRole(SORT_ROLE)

    @property
    def filtering(self) -> bool:
        return self._visible is not None

    def is_match(self, node: Node) -> bool:
        return id(node) in self._matched_ids

    def set_filter(self, spec: EntryFilter, root: Node | None) -> None:
        """Apply ``spec`` (raises ``re.error`` / ``ValueError`` for a bad pattern, changing nothing)."""
        total = sum(1 for n in root.walk() if n.entry is not None) if root is not None else 0
        if not spec.active or root is None:
            visible: set[int] | None = None
            matched: set[int] = set()
            totals: dict[int, Aggregate] = {}
        else:
            accept = spec.compile()
            matched = {id(n) for n in root.walk() if n.entry is not None and accept(n.entry)}
            totals = aggregate(root, matched)
            visible = {k for k, agg in totals.items() if agg.entries}

        def change() -> None:
            self._visible, self._matched_ids, self._totals = visible, matched, totals
            self.matched = len(matched) if visible is not None else total
            self.total = total

        change_filter(self, change)

    def filterAcceptsRow(self, source_row: int, source_parent: AnyIndex) -> bool:
        if self._visible is None:
            return True
        index = self.sourceModel().index(source_row, 0, source_parent)
        return id(index.internalPointer()) in self._visible

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if self._visible is not None and index.isValid():
            source = self.mapToSource(index)
            node: Node = source.internalPointer()
            model = self.sourceModel()
            if isinstance(model, CheckpointTreeModel) and node.children:
                agg = self._totals.get(id(node), Aggregate())
                if role == Qt.ItemDataRole.DisplayRole:
                    return model.cell(node, index.column(), agg)
                if role == SORT_ROLE:
                    return model.sort_key(node, index.column(), agg)
            if id(node) in self._matched_ids:
                if role == Qt.ItemDataRole.FontRole:
                    font = QFont()
                    font.setBold(True)
                    return font
                if role == Qt.ItemDataRole.BackgroundRole and index.column() == NAME:
                    return QBrush(QColor(253, 230, 138, 110))
        return super().data(index, role)
