"""The file browser: a path bar with Up and Home, over a file system tree that names the checkpoint
format of what it shows (by content, cached). It follows what the window opens, and never moves a
file: drags out of it offer a copy only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from PySide6.QtCore import QDir, QModelIndex, QPersistentModelIndex, QSortFilterProxyModel, Qt, QTimer, Signal
from PySide6.QtGui import QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileSystemModel,
    QHBoxLayout,
    QHeaderView,
    QLineEdit,
    QStyle,
    QStyleOptionFrame,
    QToolButton,
    QTreeView,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import DCPStudioError, detect_format

from ..proxies import change_filter
from .file_dialogs import is_checkpoint_folder

__all__ = ["CheckpointFileModel", "FileBrowser", "PathBar"]

_LABELS = {"dcp": "DCP", "torch": "torch.save", "safetensors": "safetensors"}
_SNIFF = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".json", ".pkl", ".tar")


class CheckpointFileModel(QFileSystemModel):
    """Adds a "Checkpoint" column: DCP directories, sharded folders with their index, torch.save and
    safetensors files."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._cache: dict[tuple[str, float], str] = {}
        self.setFilter(QDir.Filter.AllDirs | QDir.Filter.Files | QDir.Filter.NoDotAndDotDot | QDir.Filter.Hidden)

    def supportedDragActions(self) -> Qt.DropAction:
        return Qt.DropAction.CopyAction  # a file manager receiving the drag may copy, never move

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return super().columnCount(parent) + 1

    def format_of(self, path: Path) -> str:
        try:
            key = (str(path), path.stat().st_mtime)
        except OSError:
            return ""
        if key not in self._cache:
            label = ""
            folder = is_checkpoint_folder(path)
            if folder or (path.is_file() and path.suffix.lower() in _SNIFF):
                try:
                    label = _LABELS.get(detect_format(path), "")
                except DCPStudioError:
                    label = ""
            self._cache[key] = label
        return self._cache[key]

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        extra = super().columnCount(index.parent())
        if index.column() == extra:
            if role == Qt.ItemDataRole.DisplayRole:
                return self.format_of(Path(self.filePath(self.index(index.row(), 0, index.parent()))))
            return None
        if role == Qt.ItemDataRole.ToolTipRole and index.column() == 0:
            return self.filePath(index)  # the whole path of a name cut short
        return super().data(index, role)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if section == super().columnCount() and role == Qt.ItemDataRole.DisplayRole:
            return "Checkpoint"
        return super().headerData(section, orientation, role)


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key with runs of digits as numbers, case folded (QCollator's numeric mode needs ICU,
    which Qt's wheels for Linux lack)."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name.casefold()) if p)


class HiddenFilter(QSortFilterProxyModel):
    """Hides dot-files and dot-folders, except those on the way to what the browser shows (the
    demo lives in ~/.local/share): a folder below a hidden one stays reachable. Sorts folders
    first, then by name with numbers as numbers (a run's step-2 before step-10)."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.keep: set[str] = set()

    def lessThan(self, left: QModelIndex | QPersistentModelIndex, right: QModelIndex | QPersistentModelIndex) -> bool:
        model = self.sourceModel()
        assert isinstance(model, QFileSystemModel)
        a, b = model.isDir(left), model.isDir(right)
        if a != b:
            return a
        return _natural(model.fileName(left)) < _natural(model.fileName(right))

    def keep_path(self, path: str) -> None:
        parts = Path(path).parts
        more = {str(Path(*parts[: i + 1])) for i in range(len(parts))} - self.keep
        if more:
            change_filter(self, lambda: self.keep.update(more))

    def filterAcceptsRow(self, source_row: int, source_parent: QModelIndex | QPersistentModelIndex) -> bool:
        model = self.sourceModel()
        index = model.index(source_row, 0, source_parent)
        name = str(index.data())
        if not name.startswith("."):
            return True
        assert isinstance(model, QFileSystemModel)
        return model.filePath(index) in self.keep


class PathBar(QLineEdit):
    """The folder shown, elided in the middle when it does not fit (both ends of a long path stay
    readable; a plain line edit would show its end only), in full in the tooltip and while edited."""

    def shown_text(self) -> str:
        """What the bar displays when it is not being edited."""
        room = self.contentsRect().width() - self.textMargins().left() - self.textMargins().right() - 8
        return self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideMiddle, max(room, 0))

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.textChanged.connect(
            lambda text: self.setToolTip(f"{text}\nThe folder shown; type a path and press Enter to go there")
        )

    def paintEvent(self, event: QPaintEvent) -> None:
        shown = self.shown_text()
        if self.hasFocus() or shown == self.text():
            super().paintEvent(event)
            return
        painter = QPainter(self)
        option = QStyleOptionFrame()
        self.initStyleOption(option)
        self.style().drawPrimitive(QStyle.PrimitiveElement.PE_PanelLineEdit, option, painter, self)
        rect = self.style().subElementRect(QStyle.SubElement.SE_LineEditContents, option, self).adjusted(4, 0, -4, 0)
        painter.setPen(self.palette().color(QPalette.ColorRole.Text))
        painter.drawText(rect, int(Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft), shown)


class FileBrowser(QWidget):
    """``activated(path)`` when a file or folder is double-clicked or Enter is pressed on it."""

    activated = Signal(object)

    def __init__(self, root: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.fs = CheckpointFileModel(self)
        self.fs.setRootPath("/")
        self.shown = HiddenFilter(self)
        self.shown.setSourceModel(self.fs)
        self.view = QTreeView()
        self.view.setModel(self.shown)
        self.view.setSortingEnabled(True)  # by name, numbers as numbers (HiddenFilter.lessThan); a click re-sorts
        self.view.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        for col in (1, 2, 3):
            self.view.setColumnHidden(col, True)
        header = self.view.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(4, QHeaderView.ResizeMode.ResizeToContents)
        self.view.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # step-10 and step-1000 stay told apart
        self.view.setIndentation(12)  # a run's step folders and their files are names a level or two down
        self.view.setDragEnabled(True)
        self.view.setDragDropMode(QAbstractItemView.DragDropMode.DragOnly)
        self.view.setDefaultDropAction(Qt.DropAction.CopyAction)
        self.view.activated.connect(lambda index: self.activated.emit(self.path_at(index)))
        self.path_bar = PathBar()
        self.path_bar.returnPressed.connect(lambda: self.set_root(self.path_bar.text()))
        self.up_button = QToolButton()
        self.up_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_FileDialogToParent))
        self.up_button.setToolTip("Up one folder (Alt+Up)")
        self.up_button.setShortcut("Alt+Up")
        self.up_button.clicked.connect(self.go_up)
        self.home_button = QToolButton()
        self.home_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_DirHomeIcon))
        self.home_button.setToolTip("Home folder")
        self.home_button.clicked.connect(lambda: self.set_root(str(Path.home())))
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(self.up_button)
        bar.addWidget(self.home_button)
        bar.addWidget(self.path_bar, 1)
        self.setMinimumWidth(self.fontMetrics().horizontalAdvance("x" * 26))  # a name and its format, never crushed
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(bar)
        layout.addWidget(self.view)
        self._scroll_to = ""
        self._scroll_timer = QTimer(self)  # a child: it dies with the browser, never fires after
        self._scroll_timer.setSingleShot(True)
        self._scroll_timer.setInterval(150)
        self._scroll_timer.timeout.connect(self._scroll)
        self.root = ""
        self.set_root(root if Path(root).is_dir() else str(Path.home()))

    def set_root(self, root: str) -> None:
        path = Path(root).expanduser()
        if not path.is_dir():
            self.path_bar.setText(self.root)
            return
        self.root = str(path.resolve())
        self.shown.keep_path(self.root)
        self.view.setRootIndex(self._index(self.root))
        self.path_bar.setText(self.root)
        self.up_button.setEnabled(Path(self.root).parent != Path(self.root))

    def go_up(self) -> None:
        self.set_root(str(Path(self.root).parent))

    def reveal(self, path: Path, *, expand: bool = False) -> None:
        """Show ``path`` selected (rooted at its folder unless it already lies below the root);
        ``expand`` opens it too (a folder)."""
        path = Path(path).resolve()
        if not str(path).startswith(self.root.rstrip("/") + "/"):
            self.set_root(str(path.parent))
        self.shown.keep_path(str(path))
        index = self._index(str(path))
        if not index.isValid():
            return
        self.view.setCurrentIndex(index)
        if expand:
            self.view.expand(index)
        self._scroll_to = str(path)  # the model lists folders asynchronously: scroll once the rows exist
        self._scroll_timer.start()

    def _scroll(self) -> None:
        if self._scroll_to:
            self.view.scrollTo(self._index(self._scroll_to))

    def _index(self, path: str) -> QModelIndex:
        return self.shown.mapFromSource(self.fs.index(path))

    def path_at(self, index: QModelIndex) -> Path:
        return Path(self.fs.filePath(self.shown.mapToSource(index.siblingAtColumn(0))))
