"""The middle pane: the open checkpoint's metadata tree, with a filter box above it.

The tree is populated lazily (:class:`~dcpstudio.app.tree_model.CheckpointTreeModel`) and seen
through :class:`~dcpstudio.app.tree_model.NameFilterProxy`; ``selection_changed`` fires when the
selected row changes.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, Qt, Signal
from PySide6.QtWidgets import QHeaderView, QLineEdit, QTreeView, QVBoxLayout, QWidget

from dcpstudio.core import Checkpoint, Node

from ..tree_model import NODE_ROLE, CheckpointTreeModel, NameFilterProxy

__all__ = ["TreePane"]


class TreePane(QWidget):
    selection_changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.filter_box = QLineEdit()
        self.filter_box.setPlaceholderText("Filter names…")
        self.filter_box.setClearButtonEnabled(True)
        self.filter_box.textChanged.connect(self._apply_filter)
        self.view = QTreeView()
        self.view.setSortingEnabled(True)
        self.view.setUniformRowHeights(True)
        self.view.setIndentation(14)
        self.view.header().setSectionResizeMode(0, QHeaderView.ResizeMode.Interactive)
        self.view.setColumnWidth(0, 280)
        self.proxy = NameFilterProxy(self)
        self.model: CheckpointTreeModel | None = None
        self._root: Node | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.filter_box)
        layout.addWidget(self.view)

    def show_checkpoint(self, ckpt: Checkpoint) -> None:
        """Show ``ckpt``'s tree (its chunk counts are computed as rows are shown)."""
        counts: dict[str, int] = {}

        def chunk_count(fqn: str) -> int | None:
            if fqn not in counts:
                try:
                    counts[fqn] = len(ckpt.chunks(fqn))
                except Exception:  # a damaged entry: the column stays empty, selecting it explains
                    return None
            return counts[fqn]

        self._root = ckpt.tree
        self.model = CheckpointTreeModel(ckpt.tree, chunk_count, self)
        self.proxy.setSourceModel(self.model)
        self.view.setModel(self.proxy)
        self.view.sortByColumn(-1, Qt.SortOrder.AscendingOrder)  # file order until a header is clicked
        self.view.setColumnWidth(0, 300)
        self.view.selectionModel().selectionChanged.connect(lambda *_: self.selection_changed.emit())
        self._apply_filter(self.filter_box.text())

    def _apply_filter(self, text: str) -> None:
        self.proxy.set_pattern(text, self._root)
        if text:
            self.view.expandToDepth(2)

    def selected_node(self) -> Node | None:
        selection = self.view.selectionModel()
        indexes = selection.selectedRows() if selection else []
        node: Node | None = indexes[0].data(NODE_ROLE) if indexes else None
        return node

    def select(self, fqn: str) -> bool:
        """Select the node whose path is ``fqn`` (expanding its parents); True when found."""
        if self.model is None:
            return False
        parent = QModelIndex()
        parts = fqn.split(".")
        found = QModelIndex()
        for depth in range(len(parts)):
            path = ".".join(parts[: depth + 1])
            while self.model.canFetchMore(parent):
                self.model.fetchMore(parent)
            found = QModelIndex()
            for row in range(self.model.rowCount(parent)):
                idx = self.model.index(row, 0, parent)
                if self.model.node(idx).path == path:
                    found = idx
                    break
            if not found.isValid():
                return False
            parent = found
        view_index = self.proxy.mapFromSource(found)
        self.view.setCurrentIndex(view_index)
        self.view.scrollTo(view_index)
        return True
