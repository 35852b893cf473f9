"""Checkpoints where they live: object storage and HTTP, read by byte range through fsspec.

Every reader in this package reads through a file object: a local one (``preadv`` on its
descriptor) or a :class:`RemoteFile`, whose ``pread`` fetches exactly the byte ranges asked for.
:class:`RemotePath` offers the part of :class:`pathlib.Path` the readers and writers use (``/``,
``name``, ``is_dir``, ``iterdir``, ``stat``...), so the format code does not care where a
checkpoint lives. The plumbing is below: URLs and errors in :mod:`.fs`, file systems, retries and
deadlines in :mod:`.calls`, bounded range reads in :mod:`.stream`.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .calls import call, filesystem
from .files import RemoteFile, RemoteWriter, shared_spans
from .fs import FetchStats, Memo, RemoteError, fetch_stats, is_url, scheme, shown_url

__all__ = [
    "FetchStats",
    "RemoteError",
    "RemoteFile",
    "RemotePath",
    "RemoteWriter",
    "as_location",
    "fetch_stats",
    "is_url",
    "shown_url",
]

INFO_TTL = 10.0
_infos: Memo[str, dict[str, Any]] = Memo(INFO_TTL)
# what a folder served over HTTP is probed for (no listings there)
_KNOWN_FILES = (
    ".metadata",
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


class RemotePath:
    """A file or folder in a remote store, with the part of :class:`pathlib.Path` we use."""

    def __init__(self, url: str, *, _fs: Any = None, _path: str | None = None) -> None:
        self.folder = url.endswith("/") and not url.endswith("://")  # "…/" names a folder
        url = url.rstrip("/") if not url.endswith("://") else url
        self.url = url
        self.http = scheme(url) in ("http", "https")
        if _fs is None:
            _fs, _path = filesystem(url)
        self.fs = _fs
        self.path = (_path or "").rstrip("/")
        self._info: dict[str, Any] | None = None

    # -- naming --------------------------------------------------------------------------------
    def __str__(self) -> str:
        return shown_url(self.url)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: RemotePath) -> bool:
        return self.url < other.url

    @property
    def is_bucket(self) -> bool:
        """Whether this names a bucket or container itself (or a host's root), not something in it."""
        return "/" not in self.path.split("://", 1)[-1].strip("/") and not self.http

    @property
    def signed(self) -> bool:
        """Whether the URL carries a query (a signed URL names one object: nothing lies below it)."""
        return "?" in self.url

    def __truediv__(self, name: str) -> RemotePath:
        if self.signed:  # a member of a signed object's folder: the signature does not cover it
            base = self.url.split("?", 1)[0]
            return RemotePath(
                f"{base}/{name}", _fs=self.fs, _path=f"{base}/{name}" if self.http else f"{self.path}/{name}"
            )
        return RemotePath(f"{self.url}/{name}", _fs=self.fs, _path=f"{self.path}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        i = name.rfind(".")
        return name[i:] if 0 < i < len(name) - 1 else ""

    @property
    def parent(self) -> RemotePath:
        if "/" not in self.path.strip("/"):
            return self
        return RemotePath(self.url.rsplit("/", 1)[0], _fs=self.fs, _path=self.path.rsplit("/", 1)[0])

    @property
    def parents(self) -> list[RemotePath]:
        out: list[RemotePath] = []
        p = self.parent
        while p != (out[-1] if out else self):
            out.append(p)
            p = p.parent
        return out

    def resolve(self) -> RemotePath:
        return self

    absolute = resolve

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    # -- what is there -------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """The store's description of the object (size, ETag, modification time): asked once per
        object within a few seconds, so that opening a checkpoint does not ask again and again."""
        if self._info is None:
            self._info = _infos.get(self.url)
            if self._info is None:
                self._info = call(self.url, "read", self.fs.info, self.path)
                _infos.put(self.url, self._info)
        return self._info

    def forget(self) -> None:
        """Drop what is known of the object (it was written or removed)."""
        self._info = None
        _infos.forget(lambda url: url == self.url)

    def _probe(self) -> dict[str, Any] | None:
        try:
            return self.info()
        except RemoteError as e:
            if str(e).endswith(": not found"):
                return None
            raise

    def exists(self) -> bool:
        return self._probe() is not None

    def is_file(self) -> bool:
        if self.folder:
            return False
        info = self._probe()
        return info is not None and info.get("type") != "directory"

    def is_dir(self) -> bool:
        if self.url.endswith("://"):
            return True
        if self.http or self.signed:  # HTTP has no folders: one is named with a trailing "/"
            return self.folder and not self.signed
        info = self._probe()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[RemotePath]:
        if self.http:  # no listings over HTTP: the files a checkpoint folder is known by
            yield from (p for p in (self / n for n in _KNOWN_FILES) if p.exists())
            return
        entries = call(self.url, "list", self.fs.ls, self.path, detail=True)
        for e in entries:
            full = str(e["name"]).rstrip("/")
            name = full.rsplit("/", 1)[-1]
            if name and full != self.path:
                child = self / name
                child._info = dict(e)
                yield child

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def stat(self) -> _Stat:
        info = self.info()
        return _Stat(int(info.get("size") or 0), _mtime(info), _etag(info))

    def mkdir(self, *args: Any, **kwargs: Any) -> None:
        """Object stores have no folders: a prefix exists once an object is under it."""

    def unlink(self, missing_ok: bool = False) -> None:
        self.forget()
        try:
            call(self.url, "delete", self.fs.rm_file, self.path)
        except RemoteError:
            if not missing_ok:
                raise

    def remove_tree(self) -> None:
        """Remove the object or everything under the prefix (quietly: there may be nothing); never
        a bucket or container itself."""
        if self.is_bucket:
            raise RemoteError(f"{self}: refusing to remove a whole bucket")
        with contextlib.suppress(RemoteError):
            call(self.url, "delete", self.fs.rm, self.path, recursive=True)
        _infos.forget(lambda url: url == self.url or url.startswith(self.url + "/"))
        self._info = None

    # -- opening -------------------------------------------------------------------------------
    def open_read(self, label: str | None = None) -> RemoteFile:
        info = self.info()
        if info.get("type") == "directory":
            raise RemoteError(f"{self}: a folder; refusing to read it as a file")
        size = int(info.get("size") or 0)
        return RemoteFile(self, size, label or str(self), shared_spans(self.url, size, _etag(info)))

    def open_write(self) -> RemoteWriter:
        return RemoteWriter(self)


@dataclass(frozen=True)
class _Stat:
    st_size: int
    st_mtime: float
    etag: str
    st_ino: int = 0
    st_dev: int = 0

    @property
    def st_mtime_ns(self) -> int:
        return int(self.st_mtime * 1e9)


def _mtime(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "updated", "Last-Modified"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
        with contextlib.suppress(TypeError, ValueError):
            from email.utils import parsedate_to_datetime

            return parsedate_to_datetime(str(value)).timestamp()
    return 0.0


def _etag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "md5Hash", "VersionId", "blob_id"):
        if info.get(key):
            return str(info[key]).strip('"')
    return ""


def as_location(value: Any) -> Any:
    """A :class:`RemotePath` for a URL, else a local :class:`~pathlib.Path`."""
    if isinstance(value, RemotePath):
        return value
    if is_url(value):
        return RemotePath(value)
    return Path(value)
