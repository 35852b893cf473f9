"""The metadata tree of an open checkpoint as a Qt item model: lazy, filtered and sorted in place.

A thin adapter over :class:`dcpstudio.core.Node`: children are exposed in batches through
``canFetchMore`` / ``fetchMore`` so a 100,000-entry checkpoint never creates all its rows at once.
Filtering and sorting happen here rather than in a ``QSortFilterProxyModel``, whose re-filtering
asks a Python model for millions of parents on a large tree: a filter resets the model to the
matches (:class:`~.tree_filter.TreeIndex` finds them), a sort reorders each node's children as
they are shown. Groups show how many entries, parameters and tensor bytes lie below them (of the
matches, while filtering); matching entries are shown bold. Entries a check found damaged
(:meth:`CheckpointTreeModel.mark`) and the groups above them carry a warning icon, red text and
the finding as their tooltip; another checkpoint gets a new model, so the marks go with the old.
The Run view shades the names by how much each entry changed at a step (:meth:`shade`): a group
by its module's change (all its tensors together) when the run gives one, else the largest below.
"""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import QAbstractItemModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QBrush, QColor, QFont

from dcpstudio.core import Node
from dcpstudio.core.checkpoints.model import printable
from dcpstudio.core.ops.report import exact_count, human_bytes, human_count

from .heat import Scale, heat_scale
from .kinds import value_type
from .tree_filter import Aggregate, EntryFilter, Selection, TreeIndex

__all__ = ["COLUMNS", "NODE_ROLE", "SORT_ROLE", "CheckpointTreeModel"]

_ITEM_FLAGS = Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable  # one enum object, not one per call
COLUMNS = ("Name", "Type", "Shape", "Params", "Size", "Chunks")
NAME, TYPE, SHAPE, PARAMS, SIZE, CHUNKS = range(len(COLUMNS))
NODE_ROLE = Qt.ItemDataRole.UserRole + 1
SORT_ROLE = Qt.ItemDataRole.UserRole + 2
_BATCH = 500
AnyIndex = QModelIndex | QPersistentModelIndex
_MARK_ROLES = (Qt.ItemDataRole.DecorationRole, Qt.ItemDataRole.ForegroundRole, Qt.ItemDataRole.ToolTipRole)
_BOLD = QFont()
_BOLD.setBold(True)
_MATCH = QBrush(QColor(253, 230, 138, 110))
_BAD = QBrush(QColor(220, 38, 38))


class CheckpointTreeModel(QAbstractItemModel):
    """Rows are tree nodes; ``chunk_count(fqn)`` supplies the Chunks column (may be None)."""

    def __init__(self, index: TreeIndex | Node, chunk_count: Any = None, parent: Any = None) -> None:
        super().__init__(parent)
        self.tree = index if isinstance(index, TreeIndex) else TreeIndex(index)
        self._root = self.tree.root
        self._chunk_count = chunk_count
        self.selection: Selection | None = None  # None: no filter
        self._sort: tuple[int, Qt.SortOrder] | None = None
        self._children: dict[int, list[Node]] = {}
        self._fetched: dict[int, int] = {}
        self._parents: dict[int, Node] = {}
        self._rows: dict[int, int] = {}
        self.marks: dict[int, str] = {}  # a damaged entry's or group's node id -> what is wrong
        self.shades: dict[int, float] = {}  # node id -> its change (a group: the largest below)
        self.shade_label = ""
        self.scale: Scale | None = None

    # -- marks ------------------------------------------------------------------------------------------
    def mark(self, findings: dict[str, str]) -> None:
        """Mark the entries in ``findings`` (fqn -> what is wrong; names the tree lacks are ignored)
        and the groups above them, replacing earlier marks; rows already shown repaint."""
        wanted = {n.entry.fqn: n for n in self.tree.entries if n.entry is not None and n.entry.fqn in findings}
        old = [self.tree.nodes[i] for i in self.marks]
        self.marks = {}
        for fqn, node in wanted.items():
            self.marks[id(node)] = findings[fqn]
            above = self.tree.parent.get(id(node))
            while above is not None and above is not self._root and id(above) not in self.marks:
                self.marks[id(above)] = "a damaged entry below"
                above = self.tree.parent.get(id(above))
        for node in [*old, *(self.tree.nodes[i] for i in self.marks)]:
            self._repaint(node)

    def shade(
        self, changes: dict[str, float | None], label: str, groups: dict[str, float | None] | None = None
    ) -> Scale | None:
        """Shade the names of the entries in ``changes`` (fqn -> change; None and names the tree
        lacks are left plain) and of the groups: by ``groups`` (a group's path -> its change: its
        module's, all its tensors together), else by the largest change below. Earlier shading is
        replaced; ``label`` says in the tooltips what the number is ("relative change at step 300:").
        Returns the scale used (None: nothing to shade)."""
        old = [self.tree.nodes[i] for i in self.shades]
        self.shades, self.shade_label = {}, label
        wanted = {k: v for k, v in changes.items() if v is not None}
        given = {k: v for k, v in (groups or {}).items() if v is not None}
        for node in self.tree.entries:
            value = wanted.get(node.entry.fqn) if node.entry is not None else None
            walk: Node | None = node
            while value is not None and walk is not None and walk is not self._root:
                here = self.shades.get(id(walk))
                if here is not None and (here >= value or math.isnan(here)):
                    break  # the groups above already hold as much
                self.shades[id(walk)] = value
                walk = self.tree.parent.get(id(walk))
        if given:
            for node in self.tree.nodes.values():
                if node.children and node.path in given:
                    self.shades[id(node)] = given[node.path]
        shown = {str(k): self.shades[k] for k in self.shades}
        self.scale = heat_scale(shown) or (Scale(1.0, 1.0) if shown else None)
        for node in [*old, *(self.tree.nodes[i] for i in self.shades)]:
            self._repaint(node)
        return self.scale

    def _repaint(self, node: Node) -> None:
        """Repaint ``node``'s row if it is shown (fetched); never fetches rows."""
        parent = self._parents.get(id(node))
        row = self._rows.get(id(node), -1)
        if parent is not None and 0 <= row < self._fetched.get(id(parent), 0):
            self.dataChanged.emit(self.createIndex(row, 0, node), self.createIndex(row, len(COLUMNS) - 1, node))

    # -- filter and sort ------------------------------------------------------------------------------
    @property
    def filtering(self) -> bool:
        return self.selection is not None

    @property
    def matched(self) -> int:
        return len(self.selection.matched) if self.selection is not None else len(self.tree.entries)

    @property
    def total(self) -> int:
        return len(self.tree.entries)

    def is_match(self, node: Node) -> bool:
        return self.selection is not None and id(node) in self.selection.matched

    def set_filter(self, spec: EntryFilter) -> None:
        """Show only what ``spec`` matches (raises ``re.error`` / ``ValueError`` for a bad pattern,
        changing nothing)."""
        selection = self.tree.select(spec) if spec.active else None
        self.beginResetModel()
        self.selection = selection
        self._forget()
        self._fetched.clear()
        self.endResetModel()

    def sort(self, column: int, order: Qt.SortOrder = Qt.SortOrder.AscendingOrder) -> None:
        """Order each node's children by ``column`` (-1: as stored); expansion and selection stay."""
        self.layoutAboutToBeChanged.emit()
        old = self.persistentIndexList()
        nodes = [(self.node(i), i.column()) for i in old]
        self._sort = None if column < 0 else (column, order)
        self._forget()
        new = []
        for node, col in nodes:
            parent = self.tree.parent.get(id(node))
            row = -1
            if parent is not None:
                self._kids(parent)
                row = self._rows.get(id(node), -1)
            ok = 0 <= row < self._fetched.get(id(parent), 0)
            new.append(self.createIndex(row, col, node) if ok else QModelIndex())
        self.changePersistentIndexList(old, new)
        self.layoutChanged.emit()

    def _forget(self) -> None:
        self._children.clear()
        self._parents.clear()
        self._rows.clear()

    def totals(self, node: Node) -> Aggregate:
        if self.selection is not None:
            return self.selection.totals.get(id(node), Aggregate())
        t = node.totals
        return Aggregate(t.count, t.params, t.tensor_bytes)

    # -- tree plumbing ----------------------------------------------------------------------------
    def node(self, index: AnyIndex) -> Node:
        return index.internalPointer() if index.isValid() else self._root

    def _kids(self, node: Node) -> list[Node]:
        kids = self._children.get(id(node))
        if kids is None:
            kids = list(node.children.values())
            if self.selection is not None:
                shown = self.selection.totals
                kids = [k for k in kids if id(k) in shown]
            if self._sort is not None:
                col, order = self._sort
                kids.sort(key=lambda k: self.sort_key(k, col), reverse=order == Qt.SortOrder.DescendingOrder)
            self._children[id(node)] = kids
            for row, kid in enumerate(kids):
                self._parents[id(kid)] = node
                self._rows[id(kid)] = row
        return kids

    def index(self, row: int, column: int, parent: AnyIndex = QModelIndex()) -> QModelIndex:  # noqa: B008
        # hasIndex() done here in Python: the view asks for thousands of indexes when a large group
        # is expanded or a row under it made current
        if parent.isValid() and parent.column() != 0:
            return QModelIndex()
        node = parent.internalPointer() if parent.isValid() else self._root
        if not (0 <= row < self._fetched.get(id(node), 0) and 0 <= column < len(COLUMNS)):
            return QModelIndex()
        return self.createIndex(row, column, self._kids(node)[row])

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
        node = self.node(parent)
        return bool(self._kids(node)) if self.selection is not None else bool(node.children)

    def canFetchMore(self, parent: AnyIndex) -> bool:
        if parent.isValid() and parent.column() != 0:
            return False
        node = self.node(parent)
        return self._fetched.get(id(node), 0) < len(self._kids(node))

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
        """The index of the node at ``path`` (a dotted name), fetching its ancestors' rows; invalid
        when there is no such node or it is filtered out."""
        parent = QModelIndex()
        node = self._root
        for part in path.split(".") if path else []:
            child = node.children.get(part)
            if child is None:
                return QModelIndex()
            self._kids(node)
            row = self._rows.get(id(child))
            if row is None:
                return QModelIndex()
            while self._fetched.get(id(node), 0) <= row:
                self.fetchMore(parent)
            parent, node = self.index(row, 0, parent), child
        return parent

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

    def cell(self, node: Node, col: int) -> Any:
        """The display text of ``node`` in column ``col``."""
        e = node.entry
        if col == NAME:
            return printable(node.name)
        group = e is None or bool(node.children)
        if col in (PARAMS, SIZE):
            if not group and (e is None or e.kind != "tensor"):
                return None
            agg = self.totals(node)
            return human_count(agg.params) if col == PARAMS else human_bytes(agg.nbytes)
        if e is None:
            if col != TYPE:
                return None
            n = self.totals(node).entries
            return f"{exact_count(n)} entries" if n != 1 else "1 entry"
        if col == TYPE:
            return value_type(e)
        if col == SHAPE:
            return "×".join(map(str, e.shape)) if e.shape else ("scalar" if e.kind == "tensor" else None)
        if col == CHUNKS and e.kind == "tensor" and self._chunk_count is not None:
            return self._chunk_count(e.fqn)
        return None

    def sort_key(self, node: Node, col: int) -> Any:
        if col == SIZE:
            return self.totals(node).nbytes
        if col == PARAMS:
            return self.totals(node).params
        if col == SHAPE:
            return node.entry.numel if node.entry is not None else -1
        if col == CHUNKS:
            value = self.cell(node, col)
            return value if isinstance(value, int) else -1
        return str(self.cell(node, col) or "").lower()

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        node: Node = index.internalPointer()
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return self.cell(node, col)
        if role == NODE_ROLE:
            return node
        if role == SORT_ROLE:
            return self.sort_key(node, col)
        if self.marks and role in _MARK_ROLES and id(node) in self.marks:
            return self._marked(node, col, role)
        if role == Qt.ItemDataRole.FontRole:
            return _BOLD if self.is_match(node) else None
        if role == Qt.ItemDataRole.BackgroundRole:
            if col == NAME and self.scale is not None and id(node) in self.shades:
                return self.scale.colour(self.shades[id(node)])
            return _MATCH if col == NAME and self.is_match(node) else None
        if role == Qt.ItemDataRole.ToolTipRole and id(node) in self.shades:
            return f"{printable(node.path)}: {self.shade_label} {self.shades[id(node)]:.4g}"
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == PARAMS:
                return f"{exact_count(self.totals(node).params)} elements"
            if col == SIZE:
                return f"{exact_count(self.totals(node).nbytes)} bytes"
            return printable(node.path)
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (PARAMS, SIZE, CHUNKS):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def _marked(self, node: Node, col: int, role: int) -> Any:
        if role == Qt.ItemDataRole.DecorationRole:
            if col != NAME:
                return None
            from PySide6.QtWidgets import QApplication, QStyle

            return QApplication.style().standardIcon(QStyle.StandardPixmap.SP_MessageBoxWarning)
        if role == Qt.ItemDataRole.ForegroundRole:
            return _BAD
        return f"{printable(node.path)}: {self.marks[id(node)]}"

    def flags(self, index: AnyIndex) -> Qt.ItemFlag:
        return _ITEM_FLAGS if index.isValid() else Qt.ItemFlag.NoItemFlags
