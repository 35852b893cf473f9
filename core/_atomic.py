"""Atomic outputs: write into a temporary sibling, rename into place only when complete and flushed.

The temporary is a hidden sibling directory ``.NAME.dcpstudio-tmp-PID-RANDOM`` holding the payload
under its final name (so a torch.save archive gets the archive name torch would give it). On any
exception -- including :class:`~.errors.CancelledError` -- the temporary is removed and the
destination is untouched. Temporaries left by a killed process are recognised by their dead PID and
removed by the next run that writes to the same destination.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import DCPStudioError, DestinationExistsError

__all__ = ["atomic_output", "fsync_tree"]

_TAG = ".dcpstudio-tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temporaries(dst: Path) -> list[Path]:
    """Remove temporaries for ``dst`` whose writing process no longer exists."""
    removed = []
    prefix = f".{dst.name}{_TAG}"
    with contextlib.suppress(OSError):
        for entry in dst.parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            pid_text = entry.name[len(prefix) :].split("-", 1)[0]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file and directory under ``path``, to stable storage."""
    paths = [path] if path.is_file() else [*sorted(p for p in path.rglob("*")), path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextlib.contextmanager
def atomic_output(dst: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a path to write the output at; move it to ``dst`` when the block succeeds.

    The caller writes a file or a directory at the yielded path and fsyncs what it wrote (the
    writers in this package do; :func:`fsync_tree` serves the others); this function makes the
    renames durable. Raises :class:`DestinationExistsError` before any work when ``dst`` exists and
    ``overwrite`` is false.
    """
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise DestinationExistsError(f"{dst} already exists; pass --overwrite to replace it")
    parent = dst.parent
    if not parent.is_dir():
        raise DCPStudioError(f"cannot write {dst}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DCPStudioError(f"cannot write {dst}: directory {parent} is not writable")
    clean_stale_temporaries(dst)
    tmp_dir = parent / f".{dst.name}{_TAG}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp_dir.mkdir()
    except OSError as e:
        raise DCPStudioError(f"cannot write {dst}: {e.strerror or e}") from e
    payload = tmp_dir / dst.name
    try:
        yield payload
        if not payload.exists():
            raise DCPStudioError(f"internal error: nothing was written for {dst}")
        if dst.exists() or dst.is_symlink():
            if not overwrite:
                raise DestinationExistsError(f"{dst} appeared while writing; pass --overwrite to replace it")
            if payload.is_file() and not dst.is_dir():
                os.replace(payload, dst)
            else:
                # Directories cannot be exchanged atomically with rename(2): park the old one inside
                # our temporary (so a crash leaves it recoverable there), move the new one in, then
                # delete the old one.
                os.replace(dst, tmp_dir / f"{dst.name}.old")
                os.replace(payload, dst)
        else:
            os.replace(payload, dst)
        _fsync_dir(parent)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
