"""A file system tree that names the checkpoint format of what it shows (by content, cached)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtWidgets import QFileSystemModel, QTreeView, QWidget

from dcpstudio.core import DCPStudioError, detect_format

__all__ = ["CheckpointFileModel", "FileBrowser"]

_LABELS = {"dcp": "DCP", "torch": "torch.save", "safetensors": "safetensors"}
_SNIFF = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".json", ".pkl", ".tar")


class CheckpointFileModel(QFileSystemModel):
    """Adds a "Checkpoint" column: DCP directories, torch.save and safetensors files."""

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._cache: dict[tuple[str, float], str] = {}

    def columnCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: B008
        return super().columnCount(parent) + 1

    def format_of(self, path: Path) -> str:
        try:
            key = (str(path), path.stat().st_mtime)
        except OSError:
            return ""
        if key not in self._cache:
            label = ""
            if (path.is_dir() and (path / ".metadata").is_file()) or (path.is_file() and path.suffix.lower() in _SNIFF):
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
        return super().data(index, role)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if section == super().columnCount() and role == Qt.ItemDataRole.DisplayRole:
            return "Checkpoint"
        return super().headerData(section, orientation, role)


class FileBrowser(QTreeView):
    def __init__(self, root: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.fs = CheckpointFileModel(self)
        self.fs.setRootPath(root)
        self.setModel(self.fs)
        self.setRootIndex(self.fs.index(root))
        for col in (1, 2, 3):
            self.setColumnHidden(col, True)
        self.setColumnWidth(0, 220)
        self.setDragEnabled(True)

    def set_root(self, root: str) -> None:
        self.fs.setRootPath(root)
        self.setRootIndex(self.fs.index(root))

    def path_at(self, index: QModelIndex) -> Path:
        return Path(self.fs.filePath(index.siblingAtColumn(0)))
