"""Atomic outputs: write into a temporary sibling, rename into place only when complete and flushed.

The temporary is a hidden sibling directory ``.NAME.dcpstudio-tmp-PID-RANDOM`` holding the payload
under its final name (so a torch.save archive gets the archive name torch would give it). On any
exception -- including :class:`~.errors.CancelledError` -- the temporary is removed and the
destination is untouched. The writer holds an exclusive ``flock`` on a lock file inside its
temporary for as long as it writes: a temporary whose lock can be taken was left by a process that
died, and the next run that writes to the same destination removes it (PIDs would not do: another
PID namespace, a container, can reuse them).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DCPStudioError, DestinationExistsError
from .remote.locations import RemotePath, as_location, is_url

__all__ = ["atomic_into", "atomic_output", "check_parent", "fsync_tree"]

_TAG = ".dcpstudio-tmp-"


_LOCK = ".dcpstudio.lock"
_UNLOCKED_GRACE = 60.0  # seconds a temporary may exist before its writer has locked it


def _abandoned(tmp: Path) -> bool:
    """Whether no process writes into the temporary ``tmp`` any more (its lock can be taken)."""
    try:
        fd = os.open(tmp / _LOCK, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        try:  # no lock yet: a writer that is just starting, or one from before locks were used
            return time.time() - tmp.lstat().st_mtime > _UNLOCKED_GRACE
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a live writer
    finally:
        os.close(fd)
    return True


def clean_stale_temporaries(dst: Path) -> list[Path]:
    """Remove temporaries for ``dst`` that no live process holds."""
    removed = []
    prefix = f".{dst.name}{_TAG}"
    with contextlib.suppress(OSError):
        for entry in dst.parent.iterdir():
            if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink() and _abandoned(entry):
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


def check_parent(dst: str | os.PathLike[str]) -> None:
    """The folder a local output ``dst`` is written in exists and takes new files."""
    dst = Path(dst).absolute()
    parent = dst.parent
    if not parent.is_dir():
        raise DCPStudioError(f"cannot write {dst}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DCPStudioError(f"cannot write {dst}: directory {parent} is not writable")


@contextlib.contextmanager
def atomic_output(dst: str | os.PathLike[str] | RemotePath, *, overwrite: bool = False) -> Iterator[Any]:
    """Yield a path to write the output at; move it to ``dst`` when the block succeeds.

    The caller writes a file or a directory at the yielded path and fsyncs what it wrote (the
    writers in this package do; :func:`fsync_tree` serves the others); this function makes the
    renames durable. Raises :class:`DestinationExistsError` before any work when ``dst`` exists and
    ``overwrite`` is false.
    """
    if isinstance(dst, RemotePath) or is_url(dst):
        with _remote_output(as_location(dst), overwrite) as where:
            yield where
        return
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise DestinationExistsError(f"{dst} already exists; pass --overwrite to replace it")
    check_parent(dst)
    parent = dst.parent
    clean_stale_temporaries(dst)
    tmp_dir, lock = _locked_stage(parent / f".{dst.name}{_TAG}{os.getpid()}-{secrets.token_hex(4)}", dst)
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
        os.close(lock)


_INTO = "dcp"  # the staging folder's name inside a folder written into: .dcp.dcpstudio-tmp-PID-RANDOM


@contextlib.contextmanager
def atomic_into(dst: Path, *, overwrite: bool, keep: Path, sidecars: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a path to write a checkpoint folder at; then move its files into the existing folder
    ``dst`` -- ``.metadata`` last, so a reader sees the new checkpoint only when whole -- and touch
    nothing else there. This is how a DCP is written into the folder that holds its source file,
    as torch's writer does: ``keep`` (the source) is never replaced, and a name that exists in
    ``dst`` is replaced only with ``overwrite`` (an old ``.metadata`` is removed first, so its data
    files are never seen with new bytes; so are the ``sidecars`` describing it, its manifest, that
    the new one does not replace). The staging folder is inside ``dst``: same file system."""
    dst = Path(dst).absolute()
    if not os.access(dst, os.W_OK | os.X_OK):
        raise DCPStudioError(f"cannot write {dst}: the directory is not writable")
    clean_stale_temporaries(dst / _INTO)
    stage, lock = _locked_stage(dst / f".{_INTO}{_TAG}{os.getpid()}-{secrets.token_hex(4)}", dst)
    payload = stage / dst.name
    try:
        yield payload
        names = sorted((p.name for p in payload.iterdir()), key=lambda n: (n == ".metadata", n))
        source = keep.resolve()
        for name in names:
            there = dst / name
            if there.resolve() == source or there.resolve() in source.parents:
                raise DCPStudioError(f"cannot write {dst}: its file {name} would replace the source {keep}")
            if (payload / name).is_dir() or (there.is_dir() and not there.is_symlink()):
                raise DCPStudioError(f"cannot write {there}: a directory; remove it yourself or choose another path")
            if (there.exists() or there.is_symlink()) and not overwrite:
                raise DestinationExistsError(f"{there} already exists; pass --overwrite to replace it")
        old = dst / ".metadata"
        if old.exists() or old.is_symlink():
            old.unlink()
            for name in set(sidecars) - set(names):  # an earlier checkpoint's manifest would describe it
                (dst / name).unlink(missing_ok=True)
            _fsync_dir(dst)
        for name in names:
            if name == ".metadata":
                _fsync_dir(dst)  # the data files' names are durable before the checkpoint appears
            os.replace(payload / name, dst / name)
        _fsync_dir(dst)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        os.close(lock)


# Published last when a folder is copied into place: a reader sees the checkpoint only when whole.
_PUBLISHED_LAST = (".metadata", ".index.json")


def refuse_bucket(dst: Any) -> None:
    """A bucket or container itself is never a destination: replacing it would clear what is not ours."""
    if isinstance(dst, RemotePath) and dst.is_bucket:
        raise DCPStudioError(f"cannot write {dst}: a bucket itself; write under a prefix in it, e.g. {dst}/ckpt")


@contextlib.contextmanager
def _remote_output(dst: RemotePath, overwrite: bool) -> Iterator[RemotePath]:
    """Object stores have no rename. A single object is uploaded in place: it appears only when its
    upload completes (an exception aborts it). A folder that does not exist yet is written in place,
    its ``.metadata`` or index last (the writers do), and removed on failure. A folder that is
    replaced is written under a temporary sibling prefix first; only when it is complete is the old
    one copied aside (inside the store), removed, and the new one copied into place, ``.metadata``/
    index last; if that fails, the old one is copied back."""
    refuse_bucket(dst)
    exists = dst.exists()
    if exists and not overwrite:
        raise DestinationExistsError(f"{dst} already exists; pass --overwrite to replace it")
    if not exists:
        try:
            yield dst
        except BaseException:
            if dst.is_dir():
                dst.remove_tree()
            raise
        return
    stage = dst.parent / f".{dst.name}{_TAG}{os.getpid()}-{secrets.token_hex(4)}"
    tmp, backup = stage / dst.name, stage / "replaced"
    keep_stage = False
    try:
        yield tmp
        if tmp.is_file() and not dst.is_dir():  # one object: replaced whole when its copy completes
            _publish(tmp, dst, [tmp])
            return
        _publish(dst, backup, _objects(dst))  # the old one aside first: if this fails, nothing changed
        try:
            _clear(dst)
            _publish(tmp, dst, _objects(tmp))
        except BaseException as failure:
            try:  # put the old one back as it was
                _clear(dst)
                _publish(backup, dst, _objects(backup))
            except BaseException:
                keep_stage = True
                raise DCPStudioError(
                    f"{failure}; restoring the replaced checkpoint failed too: it is kept at {backup}"
                ) from None
            raise
    finally:
        if not keep_stage:
            stage.remove_tree()


def _objects(root: RemotePath) -> list[RemotePath]:
    """The objects of a remote checkpoint (the object itself for a file), ``.metadata``/index last."""
    root.forget()
    if root.is_file():
        return [root]
    names = sorted(root.fs.find(root.path), key=lambda name: (name.endswith(_PUBLISHED_LAST), name))
    return [RemotePath(f"{root.url}{name[len(root.path) :]}", _fs=root.fs, _path=name) for name in names]


def _clear(root: RemotePath) -> None:
    if root.is_dir():
        root.remove_tree()
    else:
        root.unlink(missing_ok=True)


def _publish(tmp: RemotePath, dst: RemotePath, files: list[RemotePath]) -> None:
    """Copy ``files`` (under ``tmp``) to the same places under ``dst``, inside the store."""
    for f in files:
        target = RemotePath(dst.url + f.url[len(tmp.url) :], _fs=dst.fs, _path=dst.path + f.path[len(tmp.path) :])
        try:
            dst.fs.copy(f.path, target.path)
        except Exception as e:
            raise DCPStudioError(f"cannot write {target}: copying into place failed ({type(e).__name__})") from None
        target.forget()


def _locked_stage(stage: Path, dst: Path) -> tuple[Path, int]:
    """A new temporary folder for writing ``dst``, held under an exclusive lock (a concurrent
    cleaner of stale temporaries skips it): the folder and the lock's descriptor."""
    try:
        stage.mkdir()
        lock = os.open(stage / _LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        shutil.rmtree(stage, ignore_errors=True)
        raise DCPStudioError(f"cannot write {dst}: {e.strerror or e}") from e
    fcntl.flock(lock, fcntl.LOCK_EX)
    return stage, lock
