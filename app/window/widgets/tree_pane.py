"""The middle pane: the open checkpoint's metadata tree, with a filter row above it.

The tree is populated lazily (:class:`~dcpstudio.window.tree_model.CheckpointTreeModel`, which also
filters and sorts). The filter takes a name (substring, or
a regular expression with ".*" pressed), a dtype and a shape; matches are expanded and shown bold,
with "n of N entries" beside the filter. Opening another checkpoint clears the filter unless the pin
beside it is pressed (remembered in the settings). ``selection_changed`` fires when the selected row changes;
``context_requested(node, global_pos)`` when the user asks for an entry's menu.
"""

from __future__ import annotations

import re

from PySide6.QtCore import QEvent, QModelIndex, QObject, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMenu,
    QToolButton,
    QTreeView,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import Checkpoint, Node

from ..settings import Settings
from ..tree_filter import EntryFilter, TreeIndex
from ..tree_model import CHUNKS, COLUMNS, NAME, NODE_ROLE, PARAMS, SHAPE, SIZE, TYPE, CheckpointTreeModel

__all__ = ["TreePane"]

_EXPAND_LIMIT = 3000  # groups expanded to reveal matches; beyond this the user narrows the filter
_ANY_DTYPE = "any dtype"


class TreePane(QWidget):
    selection_changed = Signal()
    context_requested = Signal(object, QPoint)
    copy_requested = Signal(object)  # the node whose full name Ctrl+C copies

    def __init__(self, settings: Settings | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.filter_box = QLineEdit()
        self.filter_box.setPlaceholderText("Filter names…  (Ctrl+F)")
        self.filter_box.setClearButtonEnabled(True)
        self.filter_box.setMinimumWidth(self.filter_box.fontMetrics().horizontalAdvance("x" * 16))  # never crushed
        self.filter_box.setToolTip("Entries whose full name contains this text (or matches it, with .* pressed)")
        self.regex_button = QToolButton()
        self.regex_button.setText(".*")
        self.regex_button.setCheckable(True)
        self.regex_button.setToolTip("Treat the filter as a regular expression")
        self.dtype_box = QComboBox()
        self.dtype_box.setToolTip("Only entries of this dtype")
        self.dtype_box.addItem(_ANY_DTYPE)
        self.shape_box = QLineEdit()
        self.shape_box.setPlaceholderText("shape")
        self.shape_box.setMaximumWidth(90)
        self.shape_box.setMinimumWidth(self.shape_box.fontMetrics().horizontalAdvance("[*, 4096]") + 12)
        self.shape_box.setToolTip(
            "Only tensors of this shape: 4096 (any dimension is 4096), 4096x* (two dimensions, the first "
            "4096), [*, 128], scalar"
        )
        self.pin_button = QToolButton()
        self.pin_button.setText("Keep")  # an emoji pin is a box where no emoji font is installed
        self.pin_button.setCheckable(True)
        self.pin_button.setToolTip("Keep this filter when another checkpoint is opened")
        if settings is not None:
            self.pin_button.setChecked(settings.keep_filter())
            self.pin_button.toggled.connect(settings.set_keep_filter)
        self.match_label = QLabel()
        self.match_label.setObjectName("matchLabel")
        self._debounce = QTimer(self)
        self._debounce.setSingleShot(True)
        self._debounce.setInterval(120)
        self._debounce.timeout.connect(self.apply_filter)
        self.filter_box.textChanged.connect(self._debounce.start)
        self.shape_box.textChanged.connect(self._debounce.start)
        self.regex_button.toggled.connect(self._debounce.start)
        self.dtype_box.currentIndexChanged.connect(self._debounce.start)

        self.view = QTreeView()
        self.view.setSortingEnabled(True)
        self.view.setUniformRowHeights(True)
        self.view.setIndentation(14)
        self.view.setAllColumnsShowFocus(True)
        self.view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.view.customContextMenuRequested.connect(self._context_menu)
        header = self.view.header()
        header.setStretchLastSection(False)
        header.setMinimumSectionSize(36)
        header.setSectionsMovable(False)
        header.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        header.customContextMenuRequested.connect(self._header_menu)
        copy = QAction("Copy full name", self.view)
        copy.setShortcut(QKeySequence(QKeySequence.StandardKey.Copy))
        copy.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        copy.triggered.connect(lambda: self.copy_requested.emit(self.selected_node()))
        self.view.addAction(copy)
        self.model: CheckpointTreeModel | None = None
        self._preferred: dict[int, int] = {}  # each column's width from its widest text
        self._shrunk = False
        self.view.viewport().installEventFilter(self)

        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.filter_box, 1)
        row.addWidget(self.regex_button)
        row.addWidget(self.dtype_box)
        row.addWidget(self.shape_box)
        row.addWidget(self.pin_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(row)
        layout.addWidget(self.match_label)
        layout.addWidget(self.view)
        self.setTabOrder(self.filter_box, self.regex_button)
        self.setTabOrder(self.regex_button, self.dtype_box)
        self.setTabOrder(self.dtype_box, self.shape_box)
        self.setTabOrder(self.shape_box, self.pin_button)
        self.setTabOrder(self.pin_button, self.view)

    # -- showing a checkpoint -----------------------------------------------------------------------
    def show_checkpoint(self, ckpt: Checkpoint, index: TreeIndex | None = None) -> None:
        """Show ``ckpt``'s tree (``index``: its :class:`TreeIndex`, when a worker built it already;
        chunk counts are computed as rows are shown). The filter starts empty unless pinned."""
        if not self.pin_button.isChecked():
            self.reset_filter()
        counts: dict[str, int] = {}

        def chunk_count(fqn: str) -> int | None:
            if fqn not in counts:
                try:
                    counts[fqn] = ckpt.chunk_count(fqn)
                except Exception:  # a damaged entry: the column stays empty, selecting it explains
                    return None
            return counts[fqn]

        old = self.model
        self.model = CheckpointTreeModel(index or TreeIndex(ckpt.tree), chunk_count, self)
        self.view.setModel(self.model)
        self.view.selectionModel().selectionChanged.connect(lambda *_: self.selection_changed.emit())
        if old is not None:
            old.deleteLater()
        self._size_columns(self.model.tree)
        self.view.sortByColumn(-1, Qt.SortOrder.AscendingOrder)  # file order until a header is clicked
        self._fill_dtypes(self.model.tree)
        self.view.setColumnHidden(CHUNKS, not self.model.tree.sharded)  # shown when a tensor is in pieces
        self.apply_filter()

    def reset_filter(self) -> None:
        """Every filter field back to "show all", without filtering meanwhile."""
        fields = (self.filter_box, self.regex_button, self.dtype_box, self.shape_box)
        for w in fields:
            w.blockSignals(True)
        self.filter_box.clear()
        self.regex_button.setChecked(False)
        self.dtype_box.setCurrentIndex(0)
        self.shape_box.clear()
        for w in fields:
            w.blockSignals(False)
        self._debounce.stop()

    def clear(self) -> None:
        """Show no checkpoint (the one shown was closed)."""
        old, self.model = self.model, None
        self.view.setModel(None)
        if old is not None:
            old.deleteLater()
        self.match_label.setText("")

    def _size_columns(self, tree: TreeIndex) -> None:
        """Widths from the widest text each column can show (measuring rows would read them all):
        the name column takes the rest."""
        header = self.view.header()
        metrics = self.view.fontMetrics()
        pad = 2 * metrics.horizontalAdvance("0")
        widest = {TYPE: tree.widest_type, SHAPE: tree.widest_shape, PARAMS: "999.9 M", SIZE: "1023.9 MiB"}
        widest[CHUNKS] = "9999"
        header.setSectionResizeMode(NAME, QHeaderView.ResizeMode.Stretch)
        for col, text in widest.items():
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.Interactive)
            width = max(metrics.horizontalAdvance(text) + pad, header.sectionSizeHint(col))
            header.resizeSection(col, width)
            self._preferred[col] = width
        self._shrunk = False
        self._fit_columns()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.view.viewport() and event.type() == QEvent.Type.Resize:
            self._fit_columns()
        return super().eventFilter(watched, event)

    def _fit_columns(self) -> None:
        """A narrow tree gives the name column its room first (18 characters): the other columns
        shrink in proportion, their texts elided, and grow back to their widths as the tree widens.
        Widths a user dragged are left alone while nothing needs shrinking."""
        header = self.view.header()
        cols = [c for c in self._preferred if not header.isSectionHidden(c)]
        want = sum(self._preferred[c] for c in cols)
        room = self.view.viewport().width() - self.view.fontMetrics().horizontalAdvance("x" * 18)
        scale = 1.0 if want <= room or want == 0 else max(room, 0) / want
        if scale == 1.0 and not self._shrunk:
            return
        for c in cols:
            header.resizeSection(c, max(header.minimumSectionSize(), int(self._preferred[c] * scale)))
        self._shrunk = scale < 1.0

    def _fill_dtypes(self, tree: TreeIndex) -> None:
        current = self.dtype_box.currentText()
        names, has_values = tree.dtypes, tree.has_values
        self.dtype_box.blockSignals(True)
        self.dtype_box.clear()
        self.dtype_box.addItems([_ANY_DTYPE, *names, *(["value"] if has_values else [])])
        self.dtype_box.setCurrentText(current if self.dtype_box.findText(current) >= 0 else _ANY_DTYPE)
        self.dtype_box.blockSignals(False)

    # -- filtering --------------------------------------------------------------------------------
    def spec(self) -> EntryFilter:
        dtype = self.dtype_box.currentText()
        return EntryFilter(
            self.filter_box.text().strip(),
            self.regex_button.isChecked(),
            "" if dtype == _ANY_DTYPE else dtype,
            self.shape_box.text(),
        )

    def apply_filter(self) -> None:
        """Filter now (typing waits a moment first). A bad pattern is marked and changes nothing."""
        self._debounce.stop()
        model = self.model
        if model is None:
            return
        spec = self.spec()
        was_filtering = model.filtering
        keep = self.selected_node()
        try:
            if spec.active or was_filtering:
                model.set_filter(spec)
        except (re.error, ValueError) as e:
            self.match_label.setText(f"Not a valid pattern: {e}")
            self.match_label.setProperty("error", True)
            self._repolish(self.match_label)
            return
        self.match_label.setProperty("error", False)
        self._repolish(self.match_label)
        if model.filtering:
            self.match_label.setText(f"{model.matched:,} of {model.total:,} entries match")
            self._expand_matches()
        else:
            self.match_label.setText(f"{model.total:,} entries")
        if keep is not None:
            self.select(keep.path, scroll=True)

    @staticmethod
    def _repolish(widget: QWidget) -> None:
        widget.style().unpolish(widget)
        widget.style().polish(widget)

    def _expand_matches(self) -> None:
        """Expand every visible group (they all lead to matches), breadth first, up to a limit."""
        self.view.setUpdatesEnabled(False)
        try:
            queue = [QModelIndex()]
            expanded = 0
            model = self.model
            assert model is not None
            while queue and expanded < _EXPAND_LIMIT:
                parent = queue.pop(0)
                while model.canFetchMore(parent):
                    model.fetchMore(parent)
                for row in range(model.rowCount(parent)):
                    index = model.index(row, 0, parent)
                    if model.hasChildren(index):
                        self.view.expand(index)
                        expanded += 1
                        queue.append(index)
        finally:
            self.view.setUpdatesEnabled(True)

    # -- selection and menus ------------------------------------------------------------------------
    def selected_node(self) -> Node | None:
        selection = self.view.selectionModel()
        indexes = selection.selectedRows() if selection else []
        node: Node | None = indexes[0].data(NODE_ROLE) if indexes else None
        return node

    def select(self, fqn: str, *, scroll: bool = True) -> bool:
        """Select the node whose path is ``fqn`` (expanding its parents); True when found."""
        if self.model is None:
            return False
        found = self.model.index_of(fqn)
        if not found.isValid() or self.model.node(found).path != fqn:
            return False  # no such node, or filtered out
        self.view.setCurrentIndex(found)
        if scroll:
            self.view.scrollTo(found)
        return True

    def _context_menu(self, pos: QPoint) -> None:
        index = self.view.indexAt(pos)
        if not index.isValid():
            return
        self.view.setCurrentIndex(index)
        node = index.data(NODE_ROLE)
        if node is not None:
            self.context_requested.emit(node, self.view.viewport().mapToGlobal(pos))

    def column_menu(self) -> QMenu:
        """Show or hide columns (the name column always shows)."""
        menu = QMenu(self)
        for col in range(1, len(COLUMNS)):
            action = menu.addAction(COLUMNS[col])
            action.setCheckable(True)
            action.setChecked(not self.view.isColumnHidden(col))
            action.toggled.connect(lambda on, c=col: self.view.setColumnHidden(c, not on))
        return menu

    def _header_menu(self, pos: QPoint) -> None:
        self.column_menu().exec(self.view.header().mapToGlobal(pos))
