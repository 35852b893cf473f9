"""The metadata tree of an open checkpoint as a Qt item model, populated lazily.

A thin adapter over :class:`dcpstudio.core.Node`: children are exposed in batches through
``canFetchMore`` / ``fetchMore`` so a 100,000-entry checkpoint never creates all its rows at once.
:class:`NameFilterProxy` filters by name (a node stays visible when anything below it matches)
and sorts numerically on the size columns.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractItemModel, QModelIndex, QPersistentModelIndex, QSortFilterProxyModel, Qt

from dcpstudio.core import Node
from dcpstudio.core.model import dtype_name, printable
from dcpstudio.core.report import human_bytes

__all__ = ["COLUMNS", "NODE_ROLE", "SORT_ROLE", "CheckpointTreeModel", "NameFilterProxy"]

COLUMNS = ("Name", "Kind", "Dtype", "Shape", "Size", "Chunks")
NODE_ROLE = Qt.ItemDataRole.UserRole + 1
SORT_ROLE = Qt.ItemDataRole.UserRole + 2
_BATCH = 500
AnyIndex = QModelIndex | QPersistentModelIndex


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

    # -- data -------------------------------------------------------------------------------------
    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index: AnyIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        node: Node = index.internalPointer()
        if role == NODE_ROLE:
            return node
        col = index.column()
        e = node.entry
        if role == SORT_ROLE:
            if col == 4:
                return node.totals.nbytes
            if col == 3 and e is not None:
                return e.numel
            return str(self.data(index, Qt.ItemDataRole.DisplayRole) or "")
        if role == Qt.ItemDataRole.ToolTipRole:
            return printable(node.path)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if col == 0:
            return printable(node.name)
        if col == 4:
            return human_bytes(node.totals.nbytes)
        if e is None:
            n = node.totals.count
            return (f"{n} entries" if n != 1 else "1 entry") if col == 1 else None
        if col == 1:
            return e.kind
        if col == 2:
            return dtype_name(e.dtype)
        if col == 3:
            return "×".join(map(str, e.shape)) if e.shape else ("scalar" if e.kind == "tensor" else None)
        if col == 5 and e.kind == "tensor" and self._chunk_count is not None:
            return self._chunk_count(e.fqn)
        return None

    def flags(self, index: AnyIndex) -> Qt.ItemFlag:
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        return Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable


class NameFilterProxy(QSortFilterProxyModel):
    """Shows nodes whose path contains the filter text (case-insensitive), with their ancestors."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._visible: set[int] | None = None
        self.setSortRole(SORT_ROLE)

    def set_pattern(self, text: str, root: Node | None) -> None:
        if not text or root is None:
            self._visible = None
        else:
            needle = text.lower()
            visible: set[int] = set()

            def walk(node: Node) -> bool:
                hit = needle in node.path.lower()
                for child in node.children.values():
                    hit = walk(child) or hit
                if hit:
                    visible.add(id(node))
                return hit

            walk(root)
            self._visible = visible
        self.invalidateFilter()

    def filterAcceptsRow(self, source_row: int, source_parent: AnyIndex) -> bool:
        if self._visible is None:
            return True
        model = self.sourceModel()
        index = model.index(source_row, 0, source_parent)
        return id(index.internalPointer()) in self._visible
