"""A large DCP ``.metadata`` parsed in a child process (:mod:`.index_child`), seen from the
parent: started with the bytes the parent read, waited for with a timeout, stopped when its
result is no longer wanted. Why a child at all: see :func:`build_in_child`."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any

from ... import errors
from ...formats.dcp.index import DCPIndex
from ...pickles.unpicklers import gc_paused
from ..model import Entry
from . import metadata as dcp_metadata
from .metadata import entries_from_index, store_index

__all__ = [
    "build_in_child",
    "cancel_child",
    "finish_child",
    "index_in_child",
    "parse_in_child",
    "start_child",
    "stop_child",
    "stop_index_children",
]

TIMEOUT = 3600.0  # seconds a child may parse (a 2 GiB .metadata takes minutes)
_KNOWN = {
    name: getattr(errors, name)
    for name in ("CorruptCheckpointError", "UnsafePickleError", "UnsupportedFormatError", "MissingClassError")
}
_CHILDREN: set[subprocess.Popen[bytes]] = set()
_CHILDREN_LOCK = threading.Lock()
_STOPPED: set[int] = set()  # pids of the children stopped by stop_index_children


def stop_index_children() -> None:
    """Stop every metadata parse running in a child process (the window is closing): each waiting
    :func:`build_in_child` raises :class:`~dcpstudio.core.errors.CancelledError` at once."""
    with _CHILDREN_LOCK:
        for child in _CHILDREN:
            _cancel(child)


def parse_in_child(size: int) -> bool:
    """Whether a ``.metadata`` of ``size`` bytes is parsed in a child process."""
    return not dcp_metadata.IN_CHILD and size > dcp_metadata.CHILD_ABOVE


def build_in_child(data: bytes, label: str) -> tuple[DCPIndex, dict[str, Entry]] | None:
    """The index (and entries) of the ``.metadata`` bytes ``data``, parsed by a child process
    (:mod:`.index_child`): unpickling a large ``.metadata`` makes millions of Python objects
    (~1.4 GB at the peak for 100,000 tensors) and spends seconds in C code that holds the GIL, so a
    window's GUI thread would stutter however the work is sliced; in a child none of it touches the
    caller. The child is handed the very bytes this process read (and keyed the cache by), never the
    path. A refusal there (unsafe pickle, damaged metadata) is raised here with the same class and
    message; a child that dies or hangs is reported as damage. None when no child can be started
    here (no interpreter to run it, as in a frozen app): the caller parses in-process."""
    child = start_child(data, label)
    return None if child is None else finish_child(child, label)


def start_child(data: bytes, label: str) -> subprocess.Popen[bytes] | None:
    """A child process parsing the index of the ``.metadata`` bytes ``data`` (:func:`build_in_child`),
    running while the caller goes on; None when none can be started here. Its result is taken by
    :func:`finish_child`; one never taken is stopped by :func:`stop_child`."""
    # -P: the child's sys.path does not start with the working directory, where a stray json.py or
    # zlib.py (a downloaded model folder) would be imported in place of the real one; before 3.11,
    # -I (isolated: no user site either -- if that hides us, the parse falls back to this process)
    safe_path = "-P" if sys.version_info >= (3, 11) else "-I"
    cmd = [sys.executable, safe_path, "-m", f"{__package__}.index_child", label]
    try:
        with tempfile.TemporaryFile() as given:  # the bytes as the child's stdin: a file, no pipe to feed
            given.write(data)
            given.seek(0)
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=given)
    except OSError:
        return None
    with _CHILDREN_LOCK:
        _CHILDREN.add(child)
    return child


def index_in_child(
    md_path: Any, data: bytes, key: dict[str, Any] | None, *, wait: bool
) -> tuple[tuple[DCPIndex, dict[str, Entry]] | None, subprocess.Popen[bytes] | None]:
    """``(index and entries, None)`` of the bytes ``data`` read from ``md_path``, parsed by a child
    (``wait``; cached under ``key``), or ``(None, child)`` still parsing (:func:`start_child`);
    ``(None, None)`` when no child can run here."""
    if not wait:
        return None, start_child(data, str(md_path))
    built = build_in_child(data, str(md_path))
    if built is not None:
        store_index(md_path, built[0], key)
    return built, None


def stop_child(child: subprocess.Popen[bytes] | None) -> None:
    """Stop a child whose result is not wanted (the checkpoint closed, or failed to open)."""
    if child is None:
        return
    with _CHILDREN_LOCK:
        _CHILDREN.discard(child)
        _STOPPED.discard(child.pid)
    if child.returncode is None:
        child.kill()
    child.communicate()


def cancel_child(child: subprocess.Popen[bytes] | None) -> None:
    """Stop a child whose result a thread waits for in :func:`finish_child`: there it is a cancellation."""
    with _CHILDREN_LOCK:
        if child is not None and child in _CHILDREN:
            _cancel(child)


def _cancel(child: subprocess.Popen[bytes]) -> None:
    """Kill ``child`` (under the lock), marked so that :func:`finish_child` raises CancelledError."""
    _STOPPED.add(child.pid)
    child.kill()


def finish_child(child: subprocess.Popen[bytes], label: str) -> tuple[DCPIndex, dict[str, Entry]] | None:
    """What the child from :func:`start_child` parsed (see :func:`build_in_child`)."""
    cmd = child.args
    try:
        out, err = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise errors.CorruptCheckpointError(f"{label}: parsing its metadata took over {TIMEOUT:.0f} s") from None
    finally:
        with _CHILDREN_LOCK:
            _CHILDREN.discard(child)
            stopped = child.pid in _STOPPED
            _STOPPED.discard(child.pid)
    if stopped:
        raise errors.CancelledError(f"{label}: opening was cancelled")
    done = subprocess.CompletedProcess(cmd, child.returncode, out, err)
    if done.returncode == 1 and b"No module named" in done.stderr:
        return None
    if done.returncode == 3:
        try:
            found = json.loads(done.stderr.decode().strip().splitlines()[-1])
            cls = _KNOWN[found["error"]]
            extra = {k: found[k] for k in ("source", "what") if k in found} if cls is errors.UnsafePickleError else {}
        except (ValueError, KeyError, IndexError, UnicodeDecodeError):
            pass
        else:
            raise cls(found["message"], **extra)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise errors.CorruptCheckpointError(f"{label}: parsing its metadata failed ({tail[0][-200:]})")
    try:
        with gc_paused():
            index = DCPIndex.from_bytes(done.stdout)
            return index, entries_from_index(index)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error, RecursionError) as e:
        raise errors.CorruptCheckpointError(f"{label}: the metadata parser returned a damaged index ({e})") from e
