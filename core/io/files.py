"""Opening the files a checkpoint consists of -- and nothing else.

A checkpoint names its own files (DCP's storage entries, a safetensors index's ``weight_map``). A
hostile one names ``../other/__0_0.distcp``, ``/etc/passwd`` or a symlink to them, or a FIFO that
blocks a reader forever. Every such name goes through :func:`open_member`: relative, no ``..``,
inside the checkpoint directory after symlinks are resolved, a regular file -- checked on the open
descriptor, which is opened without blocking. :func:`open_regular` does the last part for a path the
user gave.

A checkpoint saved by a thousand ranks or more keeps that many data files open while it is read;
the usual soft limit of descriptors is 1,024, so a failed open for lack of descriptors raises the
process's soft limit toward its hard one (:func:`more_descriptors`) and tries again, and says what
to do when that cannot help.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import stat
from pathlib import Path, PurePosixPath
from typing import IO, Any, BinaryIO

from ..errors import CorruptCheckpointError, LimitError, UnsupportedFormatError
from ..units import human_bytes
from .remote.locations import RemoteFile, RemotePath, RemoteWriter

__all__ = [
    "abandon",
    "create_file",
    "file_size",
    "member_path",
    "more_descriptors",
    "open_member",
    "open_regular",
    "read_regular",
    "read_with_stat",
    "save_token",
    "sync_file",
]


def open_regular(path: Path | RemotePath, label: str | None = None) -> IO[bytes]:
    """Open ``path`` for reading if it is a regular file (a FIFO, device or directory is refused
    at once: the open does not block). A remote object opens for reads by range."""
    label = label or str(path)
    if isinstance(path, RemotePath):
        return path.open_read(label)  # type: ignore[return-value]
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno != errno.EMFILE or not more_descriptors():
                raise
            fd = os.open(path, flags)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EMFILE:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            why += f": {soft} descriptors at most, each data file of a checkpoint takes one; raise it (ulimit -n)"
            raise LimitError(f"{label}: cannot open ({why})") from e
        raise UnsupportedFormatError(f"{label}: cannot open ({why})") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
            raise UnsupportedFormatError(f"{label}: {kind}; refusing to read it")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def more_descriptors() -> bool:
    """Doubles the soft limit of open descriptors, up to the hard limit; whether it rose."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = soft * 2 if hard == resource.RLIM_INFINITY else min(hard, soft * 2)
    if want <= soft:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        return False
    return True


def read_regular(path: Path | RemotePath, limit: int, label: str | None = None) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes."""
    return read_with_stat(path, limit, label)[0]


def read_with_stat(
    path: Path | RemotePath, limit: int, label: str | None = None
) -> tuple[bytes, os.stat_result | None]:
    """:func:`read_regular`, with the status of the very descriptor the bytes were read from (None for a
    remote object): what a cache keys them by, with no window for another file to take the path."""
    label = label or str(path)
    with open_regular(path, label) as f:
        size = file_size(f)
        if size > limit:  # a size this tool does not read, not damage: said as such
            raise UnsupportedFormatError(
                f"{label}: {human_bytes(size)}, more than the {human_bytes(limit)} DCP Studio reads of such a file"
            )
        if isinstance(f, RemoteFile):  # one request for the whole, not block by block
            out = bytearray(size)
            n = f.pread(0, memoryview(out))
            return bytes(out[:n]), None
        st = os.fstat(f.fileno())
        return f.read(limit + 1)[:limit], st


def file_size(f: IO[bytes]) -> int:
    """The size of an open file, local or remote."""
    if isinstance(f, RemoteFile):
        return f.size
    return os.fstat(f.fileno()).st_size


SAVE_ID_VARIABLE = "DCPSTUDIO_SAVE_ID"


def save_token(nbytes: int = 16) -> bytes:
    """Random bytes that tell one save from another (torch.save's ``.data/serialization_id``, DCP's
    ``save_id``), as torch draws them. With ``$DCPSTUDIO_SAVE_ID`` set they are derived from it
    instead, so outputs are reproducible byte for byte: two runs, or a single-process and a
    distributed conversion, can be compared with ``cmp``."""
    seed = os.environ.get(SAVE_ID_VARIABLE)
    if seed is None:
        return os.urandom(nbytes)
    import hashlib

    return hashlib.shake_256(seed.encode()).digest(nbytes)


def create_file(path: Path | RemotePath) -> BinaryIO:
    """A new file to write (a remote object is published when it is closed without error)."""
    if isinstance(path, RemotePath):
        return path.open_write()  # type: ignore[return-value]
    return open(path, "wb")


def abandon(f: IO[Any]) -> None:
    """Close a file being written after a failure (a remote upload is aborted, not published)."""
    if isinstance(f, RemoteWriter):
        f.discard()
    else:
        f.close()


def sync_file(f: IO[Any]) -> None:
    """Flush ``f`` to stable storage (a remote object is durable once its upload completes)."""
    f.flush()
    if not isinstance(f, RemoteWriter):
        os.fsync(f.fileno())


def member_path(root: Any, name: Any, what: str) -> Any:
    """The file ``name`` (as a checkpoint names it) inside the checkpoint directory ``root``;
    :class:`CorruptCheckpointError` if it is not a plain relative name that stays inside."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CorruptCheckpointError(f"{root}: invalid name {str(name)[:80]!r} for a {what}")
    shown = repr(name[:200])
    if PurePosixPath(name).is_absolute() or os.path.isabs(name) or ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise CorruptCheckpointError(f"{root}: {shown} ({what}) lies outside the checkpoint; refusing to read it")
    if isinstance(root, RemotePath):  # no symlinks in stores; "?", "#" or "%2e%2e" would leave the prefix over HTTP
        parts = name.split("/")
        if any(p in ("", ".") or p != p.strip() for p in parts) or any(
            c in "?#%\\" or ord(c) < 0x20 or c == "\x7f" for c in name
        ):
            raise CorruptCheckpointError(f"{root}: {shown} ({what}) is not a plain relative name; refusing it")
        return root / name
    real_root = root.resolve()
    target = (root / name).resolve()
    if target != real_root and real_root not in target.parents:
        raise CorruptCheckpointError(
            f"{root}: {shown} ({what}) leads outside the checkpoint through a symlink; refusing to read it"
        )
    return target


def open_member(root: Any, name: Any, what: str) -> IO[bytes]:
    """Open a file the checkpoint at ``root`` names (see :func:`member_path`), a regular file."""
    path = member_path(root, name, what)
    try:
        return open_regular(path, str(root / name))
    except UnsupportedFormatError as e:
        raise CorruptCheckpointError(str(e).replace(": cannot open (", f": cannot open {what} (", 1)) from None
