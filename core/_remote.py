"""Checkpoints where they live: object storage and HTTP, read by byte range through fsspec.

Every reader in this package reads through a file object: a local one (``preadv`` on its
descriptor) or a :class:`RemoteFile` from here, whose :meth:`RemoteFile.pread` fetches exactly the
byte ranges asked for -- small reads through a bounded read-ahead cache (a ZIP directory, a
safetensors header and a pickle are parsed from a few such blocks), large ones split into
parallel range requests written straight into the caller's buffer. :class:`RemotePath` offers the
part of :class:`pathlib.Path` the readers and writers use (``/``, ``name``, ``is_dir``,
``iterdir``, ``stat``...), so the format code does not care where a checkpoint lives.

fsspec and the backend of each store (s3fs, gcsfs, adlfs, huggingface_hub; aiohttp for HTTP) are
optional extras, imported when a URL is first used: a missing one is named in a one-line error.
Credentials are each backend's business (environment, config files, instance roles); nothing here
reads, stores or prints them, and URLs are shown without user info or query string.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .errors import DCPStudioError

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

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# scheme -> the extra that brings its backend
_EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "adl": "azure",
    "http": "http",
    "https": "http",
    "hf": "hf",
}
_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials or an instance role",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login` or the VM's account",
    "azure": "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME/KEY or `az login`",
    "hf": "HF_TOKEN or `huggingface-cli login`",
    "http": "a URL the server accepts",
}

BLOCK = 256 << 10  # read-ahead unit for small reads
CACHED_BLOCKS = 32  # per file: 8 MiB at most
PART = 8 << 20  # large reads are split into range requests of this size, fetched in parallel
PARALLEL = 8
UPLOAD_PART = 16 << 20  # multipart upload part size (memory held per file being written)
RETRIES = 4  # attempts per range request on a transient failure


class RemoteError(DCPStudioError):
    """A remote checkpoint could not be reached, found or read (one line, no credentials)."""


@dataclass(frozen=True)
class FetchStats:
    requests: int
    bytes: int


_stats_lock = threading.Lock()
_requests = 0
_bytes = 0


def fetch_stats() -> FetchStats:
    """Range requests made and bytes fetched by this process so far (the window shows them)."""
    with _stats_lock:
        return FetchStats(_requests, _bytes)


def _count(nbytes: int) -> None:
    global _requests, _bytes
    with _stats_lock:
        _requests += 1
        _bytes += nbytes


def is_url(value: object) -> bool:
    """Whether ``value`` is a URL of a remote store (``file://`` is a local path)."""
    if not isinstance(value, str):
        return False
    m = _SCHEME.match(value)
    return m is not None and m.group(1).lower() != "file"


def shown_url(url: str) -> str:
    """``url`` without user info, query or fragment: what messages and the window show."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _scheme(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else ""


def explain(exc: BaseException, url: str, doing: str = "read") -> RemoteError:
    """One line for a backend's exception: what went wrong and what to do; never its credentials."""
    label = shown_url(url)
    scheme = _scheme(url)
    extra = _EXTRAS.get(scheme, scheme)
    name = type(exc).__name__
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, ImportError):
        return RemoteError(
            f"{label}: {scheme}:// addresses need the optional '{extra}' extra: pip install 'dcpstudio[{extra}]'"
        )
    if isinstance(exc, FileNotFoundError):
        return RemoteError(f"{label}: not found")
    if isinstance(exc, PermissionError) or "AccessDenied" in name or "Forbidden" in str(exc)[:200]:
        return RemoteError(f"{label}: access denied; check the credentials ({_CREDENTIALS.get(extra, 'the store')})")
    if "Credential" in name or "credential" in str(exc)[:300].lower():
        return RemoteError(f"{label}: no credentials found; set them up ({_CREDENTIALS.get(extra, 'the store')})")
    status = _status(exc)
    what = f"HTTP {status}" if status else name
    return RemoteError(f"{label}: cannot {doing} ({what}); check the address and the network, then retry")


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    m = re.search(r"\b([45]\d\d)\b", str(exc)[:200])
    return int(m.group(1)) if m else None


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, ImportError, RemoteError)):
        return False
    status = _status(exc)
    return status is None or status >= 500 or status in (408, 429)


_fs_lock = threading.Lock()


def _filesystem(url: str) -> tuple[Any, str]:
    """The fsspec file system for ``url`` and the path inside it."""
    try:
        import fsspec.core

        with _fs_lock:
            return fsspec.core.url_to_fs(url)
    except ValueError as e:
        if "Protocol not known" in str(e) or "not known" in str(e):
            raise RemoteError(f"{shown_url(url)}: unsupported kind of address ({_scheme(url)}://)") from None
        raise explain(e, url, "open") from None
    except Exception as e:
        raise explain(e, url, "open") from None


def _call(url: str, doing: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` retried on transient failures, its exceptions turned into one line."""
    delay = 0.2
    for attempt in range(RETRIES):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if attempt == RETRIES - 1 or not _transient(e):
                raise explain(e, url, doing) from None
        time.sleep(delay)
        delay *= 2.5
    raise AssertionError("unreachable")


class RemotePath:
    """A file or folder in a remote store, with the part of :class:`pathlib.Path` we use."""

    def __init__(self, url: str, *, _fs: Any = None, _path: str | None = None) -> None:
        self.folder = url.endswith("/") and not url.endswith("://")  # "…/" names a folder
        url = url.rstrip("/") if not url.endswith("://") else url
        self.url = url
        self.http = _scheme(url) in ("http", "https")
        if _fs is None:
            _fs, _path = _filesystem(url)
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

    def __truediv__(self, name: str) -> RemotePath:
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
            now = time.monotonic()
            with _info_lock:
                seen = _infos.get(self.url)
            if seen is not None and now - seen[0] < INFO_TTL:
                self._info = seen[1]
            else:
                self._info = _call(self.url, "read", self.fs.info, self.path)
                with _info_lock:
                    _infos[self.url] = (now, self._info)
                    while len(_infos) > 4096:
                        del _infos[next(iter(_infos))]
        return self._info

    def forget(self) -> None:
        """Drop what is known of the object (it was written or removed)."""
        self._info = None
        with _info_lock:
            _infos.pop(self.url, None)

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
        if self.http:  # HTTP has no folders: one is named with a trailing "/" or holds a known file
            return self.folder or any(True for _ in self.iterdir())
        info = self._probe()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[RemotePath]:
        if self.http:  # no listings over HTTP: the files a checkpoint folder is known by
            yield from (p for p in (self / n for n in _KNOWN_FILES) if p.exists())
            return
        entries = _call(self.url, "list", self.fs.ls, self.path, detail=True)
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
            _call(self.url, "delete", self.fs.rm_file, self.path)
        except RemoteError:
            if not missing_ok:
                raise

    def remove_tree(self) -> None:
        """Remove the object or everything under the prefix (quietly: there may be nothing)."""
        with contextlib.suppress(RemoteError):
            _call(self.url, "delete", self.fs.rm, self.path, recursive=True)
        with _info_lock:
            for url in [u for u in _infos if u == self.url or u.startswith(self.url + "/")]:
                del _infos[url]
        self._info = None

    # -- opening -------------------------------------------------------------------------------
    def open_read(self, label: str | None = None) -> RemoteFile:
        info = self.info()
        if info.get("type") == "directory":
            raise RemoteError(f"{self}: a folder; refusing to read it as a file")
        return RemoteFile(self, int(info.get("size") or 0), label or str(self))

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


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="dcpstudio-fetch")
        return _pool


_infos: dict[str, tuple[float, dict[str, Any]]] = {}
_info_lock = threading.Lock()
INFO_TTL = 10.0
# what a folder served over HTTP is probed for (no listings there)
_KNOWN_FILES = (
    ".metadata",
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


class RemoteFile(io.RawIOBase):
    """A remote object read by byte range. :meth:`pread` is thread-safe (no shared position)."""

    def __init__(self, where: RemotePath, size: int, label: str) -> None:
        super().__init__()
        self.where = where
        self.size = size
        self.label = label
        self.name = str(where)
        self._pos = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a remote object has no file descriptor")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = self.pread(self._pos, memoryview(b).cast("B"))
        self._pos += n
        return n

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        n = self.readinto(out)
        return bytes(out[:n])

    def _fetch(self, start: int, end: int) -> bytes:
        data = _call(self.where.url, "read", self.where.fs.cat_file, self.where.path, start=start, end=end)
        _count(len(data))
        if len(data) != end - start:
            raise RemoteError(
                f"{self.label}: asked for bytes {start}-{end}, got {len(data)}; the object changed or the server "
                "ignores range requests"
            )
        return bytes(data)

    def pread(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` with the bytes at ``offset`` (fewer at the end of the object)."""
        end = min(self.size, offset + len(out))
        if end <= offset:
            return 0
        n = end - offset
        if n >= 2 * BLOCK:
            self._read_large(offset, out[:n])
        else:
            self._read_cached(offset, out[:n])
        return n

    def _read_large(self, offset: int, out: memoryview) -> None:
        n = len(out)
        spans = [(s, min(n, s + PART)) for s in range(0, n, PART)]

        def one(span: tuple[int, int]) -> None:
            a, b = span
            out[a:b] = self._fetch(offset + a, offset + b)

        if len(spans) == 1:
            one(spans[0])
            return
        for f in [_threads().submit(one, s) for s in spans]:
            f.result()

    def _read_cached(self, offset: int, out: memoryview) -> None:
        first, last = offset // BLOCK, (offset + len(out) - 1) // BLOCK
        with self._lock:
            have = {k: self._blocks[k] for k in range(first, last + 1) if k in self._blocks}
        missing = [k for k in range(first, last + 1) if k not in have]
        if missing:
            a, b = missing[0] * BLOCK, min(self.size, (missing[-1] + 1) * BLOCK)
            data = self._fetch(a, b)
            for k in range(missing[0], missing[-1] + 1):
                have[k] = data[(k - missing[0]) * BLOCK : (k - missing[0] + 1) * BLOCK]
            with self._lock:
                for k in missing:
                    self._blocks[k] = have[k]
                while len(self._blocks) > CACHED_BLOCKS:
                    self._blocks.popitem(last=False)
        pos = 0
        for k in range(first, last + 1):
            block = have[k]
            lo = offset + pos - k * BLOCK
            piece = block[lo : lo + len(out) - pos]
            out[pos : pos + len(piece)] = piece
            pos += len(piece)


class RemoteWriter(io.RawIOBase):
    """A new remote object, uploaded as it is written (multipart on object stores) and published
    only by a successful close; an exception inside ``with`` discards it (aborts the upload)."""

    def __init__(self, where: RemotePath) -> None:
        super().__init__()
        self.where = where
        self.name = str(where)
        self._f = _call(where.url, "write", where.fs.open, where.path, "wb", block_size=UPLOAD_PART)
        self._pos = 0

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a remote object has no file descriptor")

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._f.write(view)
        except Exception as e:
            raise explain(e, self.where.url, "write") from None
        self._pos += len(view)
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        self.where.forget()
        try:
            self._f.close()
        except Exception as e:
            self.discard()
            raise explain(e, self.where.url, "write") from None
        finally:
            super().close()

    def discard(self) -> None:
        """Abandon the object: abort its upload, publish nothing."""
        with contextlib.suppress(Exception):
            if hasattr(self._f, "discard"):
                self._f.discard()
            self._f.closed = True
        with contextlib.suppress(Exception):
            super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()


def as_location(value: Any) -> Any:
    """A :class:`RemotePath` for a URL, else a local :class:`~pathlib.Path`."""
    if isinstance(value, RemotePath):
        return value
    if is_url(value):
        return RemotePath(value)
    return Path(value)
