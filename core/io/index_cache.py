"""A persistent cache of derived indexes (what parsing a large file found), so that opening the
same unchanged file again costs a read of the cache instead of a parse.

An entry is keyed by the source file's identity and content: its resolved path, size, modification
and change times, inode and device -- taken from the descriptor its bytes were read through -- and
the SHA-256 of those bytes. Whoever builds the index builds it from exactly the bytes hashed (the
parse in a child process is handed them, it does not open the path again), so a folder swapped
while a parse runs cannot leave another file's index under this key; and an index is stored only
while the path still names the file as it was read (a file changed meanwhile: nothing stored). The
cache never holds pickle: a payload is whatever bytes the caller serialised (JSON and typed arrays
for the DCP index), framed here by a header that repeats the key, the payload's length and its
CRC-32. Anything that does not match -- another key, another format version, a short or damaged
file -- is ignored, and the caller rebuilds and stores it again.

Files live in ``$XDG_CACHE_HOME/dcpstudio/index`` (``~/.cache/dcpstudio/index``), a folder of mode
0700 holding files of mode 0600; a folder or file owned by another user, or open to others, is not
read (another user could have planted an index there). Files are written to a temporary sibling and
renamed into place (readers never see a partial file), and are safe to delete at any time. Their
total size is bounded: storing evicts the least recently used. A cache folder that cannot be written
(read-only home, full disk) is skipped silently: the cache only ever makes things faster.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

__all__ = ["MAX_BYTES", "cache_dir", "identity", "load", "source_key", "store"]

MAX_BYTES = 2 << 30  # total size of the cache folder, kept by evicting the least recently used
_MAGIC = b"DCPSIDX\x01"
_HEAD = struct.Struct("<8sI")  # magic, header length
_SUFFIX = ".idx"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dcpstudio" / "index"


def source_key(
    source: Any, kind: str, content: bytes, st: os.stat_result | None = None, *, before: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The key of ``content``, the bytes read from ``source`` through a descriptor whose status is ``st``
    (None: stat'ed now): the file's identity and the SHA-256 of the bytes. A remote object is known by
    its URL, size, modification time and ETag -- the store's own digest of its content, so its bytes
    need not be fetched again to find a cached index -- as :func:`identity` gave ``before`` the read
    and gives after it: an object replaced meanwhile, or without a strong ETag, has no key. None when
    ``source`` cannot be stat'ed."""
    found = identity(source, kind, st)
    if found is None or isinstance(source, Path):
        if found is not None:
            found["sha256"] = hashlib.sha256(content).hexdigest()
        return found
    return found if found == before else None


def identity(source: Any, kind: str, st: os.stat_result | None = None) -> dict[str, Any] | None:
    """What names ``source`` (see :func:`source_key`), without its content."""
    if not isinstance(source, Path):
        try:
            remote = source.stat()
        except Exception:
            return None
        etag = getattr(remote, "etag", "") or ""
        if not etag or etag.startswith("W/"):  # a weak ETag does not name the bytes
            return None
        return {
            "kind": kind,
            "path": str(source),
            "size": remote.st_size,
            "mtime": remote.st_mtime,
            "etag": remote.etag,
        }
    try:
        path = source.resolve()
        st = st or os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {
        "kind": kind,
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
        "byteorder": sys.byteorder,
    }


def _file_for(key: dict[str, Any]) -> Path:
    name = hashlib.sha256(f"{key['kind']}\0{key['path']}".encode(errors="surrogatepass")).hexdigest()[:40]
    return cache_dir() / f"{name}{_SUFFIX}"


def _ours(st: os.stat_result) -> bool:
    """Owned by this user and closed to others (where the system has users)."""
    getuid = getattr(os, "getuid", None)
    return getuid is None or (st.st_uid == getuid() and not st.st_mode & 0o077)


def _folder(create: bool) -> Path | None:
    """The cache folder if it is this user's alone (made so when ``create``); None otherwise."""
    folder = cache_dir()
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            return None
        if create and st.st_mode & 0o077 and st.st_uid == getattr(os, "getuid", lambda: st.st_uid)():
            os.chmod(folder, 0o700)  # ours, made by an older version: closed now
            st = os.lstat(folder)
    except OSError:
        return None
    return folder if _ours(st) else None


def load(key: dict[str, Any] | None) -> tuple[dict[str, Any], memoryview] | None:
    """The cached header and payload under ``key`` (:func:`source_key`) when one exists for exactly
    that file and content, intact and this user's own; None otherwise (never raises)."""
    if key is None or _folder(create=False) is None:
        return None
    path = _file_for(key)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or not _ours(st):
                return None
            data = f.read()
        magic, size = _HEAD.unpack_from(data)
        if magic != _MAGIC:
            return None
        header = json.loads(bytes(data[_HEAD.size : _HEAD.size + size]))
        payload = memoryview(data)[_HEAD.size + size :]
        if (
            not isinstance(header, dict)
            or header.get("key") != key
            or header.get("length") != len(payload)
            or header.get("crc32") != zlib.crc32(payload)
        ):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
    except (OSError, ValueError, struct.error, UnicodeDecodeError, RecursionError):
        return None
    return header, payload


def store(
    source: Any, key: dict[str, Any] | None, payload: bytes | bytearray, meta: dict[str, Any] | None = None
) -> bool:
    """Write ``payload`` (with the caller's ``meta`` in its header) as the cache entry under ``key``,
    the key of the bytes it was built from -- only if ``source`` is still the file they were read
    from, unchanged (size, times, inode); False when not stored (nothing raised: the cache folder may
    be unwritable)."""
    if key is None:
        return False
    now = identity(source, key["kind"])
    if now is None or now != {k: v for k, v in key.items() if k != "sha256"}:
        return False
    folder = _folder(create=True)
    if folder is None:
        return False
    path = _file_for(key)
    header = json.dumps(
        {**(meta or {}), "key": key, "length": len(payload), "crc32": zlib.crc32(payload)}, separators=(",", ":")
    ).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _evict(folder, MAX_BYTES - len(payload) - len(header))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        with open(fd, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, len(header)))
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


def _evict(folder: Path, room: int) -> None:
    """Remove the least recently used entries (and temporaries left by dead writers) until the
    folder holds at most ``room`` bytes."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, st.st_size, entry.path))
    found.sort()
    total = sum(size for _, size, _ in found)
    for _, size, where in found:
        if total <= max(room, 0):
            break
        with contextlib.suppress(OSError):
            os.unlink(where)
            total -= size
