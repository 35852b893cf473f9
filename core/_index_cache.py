"""A persistent cache of derived indexes (what parsing a large file found), so that opening the
same unchanged file again costs a read of the cache instead of a parse.

An entry is keyed by the source file's identity: its resolved path, size, modification and change
times, inode and device. The change time cannot be set by a user (``touch -r`` sets the
modification time, and bumps the change time), so a file rewritten in place under the same size
and modification time still misses. The cache never holds pickle: a payload is whatever bytes
the caller serialised (JSON and typed arrays for the DCP index), framed here by a header that
repeats the key, the payload's length and its CRC-32. Anything that does not match -- another
key, another format version, a short or damaged file -- is ignored, and the caller rebuilds and
stores it again.

Files live in ``$XDG_CACHE_HOME/dcpstudio/index`` (``~/.cache/dcpstudio/index``), are written to a
temporary sibling and renamed into place (readers never see a partial file), and are safe to
delete at any time. Their total size is bounded: storing evicts the least recently used. A
cache folder that cannot be written (read-only home, full disk) is skipped silently: the cache
only ever makes things faster.
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

__all__ = ["MAX_BYTES", "cache_dir", "load", "source_key", "store"]

MAX_BYTES = 2 << 30  # total size of the cache folder, kept by evicting the least recently used
_MAGIC = b"DCPSIDX\x01"
_HEAD = struct.Struct("<8sI")  # magic, header length
_SUFFIX = ".idx"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dcpstudio" / "index"


def source_key(source: Path, kind: str) -> dict[str, Any] | None:
    """The identity of ``source`` as the cache keys it (None when it cannot be stat'ed). A remote
    object is known by its URL, size, modification time and ETag (None without an ETag)."""
    if not isinstance(source, Path):
        try:
            st = source.stat()
        except Exception:
            return None
        if not getattr(st, "etag", ""):
            return None
        return {"kind": kind, "path": str(source), "size": st.st_size, "mtime": st.st_mtime, "etag": st.etag}
    try:
        path = source.resolve()
        st = os.stat(path)
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


def load(source: Path, kind: str) -> tuple[dict[str, Any], memoryview] | None:
    """The cached header and payload for ``source`` when one exists for exactly this file (same
    key), intact; None otherwise (never raises)."""
    key = source_key(source, kind)
    if key is None:
        return None
    path = _file_for(key)
    try:
        with open(path, "rb") as f:
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
    source: Path,
    kind: str,
    payload: bytes | bytearray,
    meta: dict[str, Any] | None = None,
    *,
    expect: dict[str, Any] | None = None,
) -> bool:
    """Write ``payload`` (with the caller's ``meta`` in its header) as the cache entry for
    ``source`` as it is now -- and only if that is still ``expect`` (its key when the caller read
    it) when given; False when not stored (nothing raised: the cache folder may be unwritable)."""
    key = source_key(source, kind)
    if key is None or (expect is not None and key != expect):
        return False
    path = _file_for(key)
    header = json.dumps(
        {**(meta or {}), "key": key, "length": len(payload), "crc32": zlib.crc32(payload)}, separators=(",", ":")
    ).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _evict(path.parent, MAX_BYTES - len(payload) - len(header))
        with open(tmp, "xb") as f:
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
