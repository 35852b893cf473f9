"""Where a checkpoint is: a local path, or the URL of a remote store (s3://, gs://, az://,
https://, hf://), and what a drop brings (a file, or a URL dragged from a browser or a terminal).

The window carries a remote location as its URL string and never asks a remote store anything on
the GUI thread: a :class:`~dcpstudio.core.io.remote.locations.RemotePath`'s ``is_dir``, ``exists`` and
``stat`` are network requests, which only workers may wait for. Naming a location (``shown``,
``name_of``) reads the URL's text only.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from PySide6.QtCore import Qt
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent

from dcpstudio.core.io.remote.locations import RemotePath, is_url

__all__ = [
    "Location",
    "accept_copy",
    "dropped_locations",
    "is_remote",
    "location",
    "name_of",
    "shown",
    "without_secrets",
]

Location = Path | str  # a local path, or a URL


def is_remote(value: object) -> bool:
    return isinstance(value, RemotePath) or is_url(value)


def location(value: object) -> Location:
    """A URL string for anything remote (a RemotePath gives its full URL), else a local Path."""
    if isinstance(value, RemotePath):
        return value.url
    if isinstance(value, str) and is_url(value):
        return value
    return Path(value)  # type: ignore[arg-type]


def without_secrets(url: str) -> str:
    """``url`` without user info, query or fragment (what is shown and remembered). Unlike core's
    ``shown_url`` it keeps the host's case: hf://Org/repo names a case-sensitive Hub organisation."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))


def shown(value: object) -> str:
    """The location as the window shows it: a URL without credentials or query."""
    where = location(value)
    return without_secrets(where) if isinstance(where, str) else str(where)


def name_of(value: object) -> str:
    """The last part of the location's name ("ckpt" for s3://bucket/runs/ckpt/)."""
    where = location(value)
    if isinstance(where, Path):
        return where.name
    text = without_secrets(where).rstrip("/")
    return text.rsplit("/", 1)[-1] if "/" in text.split("://", 1)[-1] else text


def dropped_locations(event: QDropEvent | QDragEnterEvent | QDragMoveEvent) -> list[Location]:
    """Local files and remote URLs of a drop (a URL may also come as plain text)."""
    mime = event.mimeData()
    found: list[Location] = []
    if mime.hasUrls():
        for u in mime.urls():
            if u.isLocalFile():
                found.append(Path(u.toLocalFile()))
            elif is_url(u.toString()):
                found.append(u.toString())
    if not found and mime.hasText():
        lines = mime.text().strip().splitlines()
        if lines and is_url(lines[0].strip()):
            found.append(lines[0].strip())
    return found


def accept_copy(event: QDropEvent | QDragEnterEvent | QDragMoveEvent) -> bool:
    """Accept a drag of local files or URLs as a *copy*: the source (a file manager) must never
    delete the user's file because we took it as a move."""
    if not dropped_locations(event) or not (event.possibleActions() & Qt.DropAction.CopyAction):
        event.ignore()
        return False
    event.setDropAction(Qt.DropAction.CopyAction)
    event.accept()
    return True
