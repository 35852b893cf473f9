"""The remote stores' plumbing under :mod:`.locations`: URLs, one-line errors, what is worth a
retry, and the counters of what was fetched (file systems and retries: :mod:`.calls`).

fsspec and the backend of each store (s3fs, gcsfs, adlfs, huggingface_hub; aiohttp for HTTP) are
optional extras, imported when a URL is first used: a missing one is named in a one-line error.
Credentials are each backend's business (environment, config files, instance roles); nothing here
reads, stores or prints them, and URLs are shown without user info or query string.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ...errors import DCPStudioError

__all__ = [
    "RETRIES",
    "FetchStats",
    "Memo",
    "RemoteError",
    "backend",
    "count",
    "explain",
    "fetch_stats",
    "is_url",
    "scheme",
    "shown_url",
    "threads",
    "transient",
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

PARALLEL = 8  # range requests in flight for one large read
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


def count(nbytes: int, requests: int = 1) -> None:
    global _requests, _bytes
    with _stats_lock:
        _requests += requests
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
    host = parts.netloc.rsplit("@", 1)[-1]  # as written: hf://Org/… and bucket names keep their case
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def scheme(url: str) -> str:
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else ""


def explain(exc: BaseException, url: str, doing: str = "read") -> RemoteError:
    """One line for a backend's exception: what went wrong and what to do; never its credentials."""
    label = shown_url(url)
    kind = scheme(url)
    extra = _EXTRAS.get(kind, kind)
    name = type(exc).__name__
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, ImportError):
        return RemoteError(
            f"{label}: {kind}:// addresses need the optional '{extra}' extra: pip install 'dcpstudio[{extra}]'"
        )
    cause = exc.__cause__
    if isinstance(exc, FileNotFoundError) and cause is not None and not _missing(cause):
        exc = cause  # fsspec's HTTP file system calls a refused connection "not found"
        name = type(exc).__name__
    status = _status(exc)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return RemoteError(f"{label}: not found")
    if isinstance(exc, PermissionError) or status in (401, 403) or "AccessDenied" in name:
        return RemoteError(f"{label}: access denied; check the credentials ({_CREDENTIALS.get(extra, 'the store')})")
    if "Credential" in name or "credential" in _URLS.sub("", str(exc)[:300]).lower():
        return RemoteError(f"{label}: no credentials found; set them up ({_CREDENTIALS.get(extra, 'the store')})")
    if status is None and (name in _DROPPED or "payload is not completed" in str(exc)[:200]):
        return RemoteError(f"{label}: cannot {doing}: the connection was dropped mid-transfer, each retry too")
    if status is None and name in _REFUSED:
        return RemoteError(f"{label}: cannot {doing}: the server cannot be reached ({name}); check the address")
    what = f"HTTP {status}" if status else name
    detail = _URLS.sub("…", str(exc).strip().splitlines()[0] if str(exc).strip() else "")[:120]
    if detail and detail not in what:
        what = f"{what}: {detail}"
    return RemoteError(f"{label}: cannot {doing} ({what}); check the address and the network, then retry")


_DROPPED = {
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ConnectionResetError",
    "IncompleteRead",
    "ReadTimeoutError",
}
_REFUSED = {"ClientConnectorError", "ConnectionRefusedError", "ClientConnectorDNSError", "EndpointConnectionError"}
_URLS = re.compile(r"\S*://\S*|\S*[?&][A-Za-z-]+=\S*")  # addresses and query strings never reach a message


def _missing(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the object does not exist."""
    while exc is not None:
        if (isinstance(exc, FileNotFoundError) and exc.__cause__ is None) or _status(exc) == 404:
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    m = _STATUS_TEXT.search(str(exc)[:300])
    return int(m.group(1) or m.group(2)) if m else None


# "403, message='Forbidden'" (aiohttp), "... (503)", "status 500", "HTTP 404", "Error code 403"
_STATUS_TEXT = re.compile(r"^\s*([45]\d\d)\b|(?:status|HTTP|code)\W{0,3}([45]\d\d)\b", re.IGNORECASE)


def backend(url: str) -> str:
    """Which extra serves ``url``'s scheme (``"s3"``, ``"http"``...), or the scheme itself."""
    kind = scheme(url)
    return _EXTRAS.get(kind, kind)


def transient(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, ImportError, RemoteError)):
        return False
    status = _status(exc)
    return status is None or status >= 500 or status in (408, 429)


K = TypeVar("K")
V = TypeVar("V")


class Memo(Generic[K, V]):
    """Values remembered for ``ttl`` seconds from when they were stored (at most ``most`` of them,
    the oldest forgotten first); thread-safe."""

    def __init__(self, ttl: float, most: int = 4096) -> None:
        self.ttl, self.most = ttl, most
        self._values: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._fresh(key, time.monotonic())

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._store(key, value, time.monotonic())

    def setdefault(self, key: K, make: Callable[[], V]) -> V:
        """The value remembered for ``key``, else ``make()``'s, remembered from now."""
        with self._lock:
            now = time.monotonic()
            value = self._fresh(key, now)
            if value is None:
                value = make()
                self._store(key, value, now)
            return value

    def forget(self, which: Callable[[K], bool]) -> None:
        with self._lock:
            for key in [k for k in self._values if which(k)]:
                del self._values[key]

    def _fresh(self, key: K, now: float) -> V | None:
        seen = self._values.get(key)
        if seen is None:
            return None
        if now - seen[0] >= self.ttl:
            del self._values[key]
            return None
        return seen[1]

    def _store(self, key: K, value: V, now: float) -> None:
        self._values.pop(key, None)
        self._values[key] = (now, value)  # kept in the order stored: the oldest first
        while self._values:
            oldest = next(iter(self._values))
            if len(self._values) <= self.most and now - self._values[oldest][0] < self.ttl:
                break
            del self._values[oldest]


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="dcpstudio-fetch")
        return _pool
