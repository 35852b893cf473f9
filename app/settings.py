"""What the window remembers between runs: recent files, geometry, the last directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings

__all__ = ["Settings"]

_MAX_RECENT = 10


class Settings:
    def __init__(self) -> None:
        self._s = QSettings("DCPStudio", "DCPStudio")

    def recent(self) -> list[str]:
        value: Any = self._s.value("recent", [])
        items = [value] if isinstance(value, str) else list(value or [])
        return [str(v) for v in items]

    def add_recent(self, path: Path) -> None:
        items = [str(path)] + [p for p in self.recent() if p != str(path)]
        self._s.setValue("recent", items[:_MAX_RECENT])
        self._s.setValue("last_dir", str(path.parent))

    def last_dir(self) -> str:
        return str(self._s.value("last_dir", str(Path.home())))

    def geometry(self) -> QByteArray | None:
        value = self._s.value("geometry")
        return value if isinstance(value, QByteArray) else None

    def set_geometry(self, data: QByteArray) -> None:
        self._s.setValue("geometry", data)

    def sync(self) -> None:
        self._s.sync()
