"""What the window remembers between runs: recent files and URLs, geometry, the last directory.

A recent URL is kept as the window shows it, without user info or query string: credentials and
signed-URL tokens are never written to the settings file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSettings

from .locations import without_secrets

__all__ = ["Settings"]

_MAX_RECENT = 10


class Settings:
    def __init__(self) -> None:
        self._s = QSettings("DCPStudio", "DCPStudio")

    def _list(self, key: str) -> list[str]:
        value: Any = self._s.value(key, [])
        items = [value] if isinstance(value, str) else list(value or [])
        return [str(v) for v in items]

    def _push(self, key: str, item: str) -> None:
        self._s.setValue(key, ([item] + [p for p in self._list(key) if p != item])[:_MAX_RECENT])

    def recent(self) -> list[str]:
        return self._list("recent")

    def add_recent(self, path: Path) -> None:
        self._push("recent", str(path))
        self._s.setValue("last_dir", str(path.parent))

    def recent_urls(self) -> list[str]:
        """Remote checkpoints opened lately, most recent first."""
        return self._list("recent_urls")

    def add_recent_url(self, url: str) -> None:
        self._push("recent_urls", without_secrets(url))

    def last_dir(self) -> str:
        return str(self._s.value("last_dir", str(Path.home())))

    def keep_filter(self) -> bool:
        """Whether the tree's filter stays when another checkpoint is opened (off unless pinned)."""
        return str(self._s.value("keep_filter", "false")).lower() == "true"

    def set_keep_filter(self, keep: bool) -> None:
        self._s.setValue("keep_filter", "true" if keep else "false")

    def actions_shown(self) -> bool:
        """Whether the Convert/Load area is unfolded (it is, unless folded away last time)."""
        return str(self._s.value("actions_shown", "true")).lower() == "true"

    def set_actions_shown(self, shown: bool) -> None:
        self._s.setValue("actions_shown", "true" if shown else "false")

    def geometry(self) -> QByteArray | None:
        value = self._s.value("geometry")
        return value if isinstance(value, QByteArray) else None

    def set_geometry(self, data: QByteArray) -> None:
        self._s.setValue("geometry", data)

    def sync(self) -> None:
        self._s.sync()
