# ruff: noqa: F811  # the fixtures imported from test_index_cache are parameters here
"""The index cache cannot be made to hold another file's index: key and content come from the same
read, the child parses the bytes the parent hashed, a file changed meanwhile stores nothing, and the
cache is this user's alone (issue 24, item 3)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from dcpstudio.core import open_checkpoint
from dcpstudio.core.checkpoints.dcp import checkpoint as dcp_module
from dcpstudio.core.checkpoints.dcp import children as dcp_children
from dcpstudio.core.checkpoints.dcp import metadata as dcp_metadata
from dcpstudio.core.io import index_cache as _index_cache
from tests.core.test_index_cache import (  # noqa: F401  # fixtures (chunked, parses, ...)
    _cache_files,
    _edit_metadata,
    _summary,
    cache_every_size,
    chunked,
    in_child,
    key,
    parses,
)


def _other(chunked: Path, tmp_path: Path) -> Path:
    """The same entries, other storage: every record moved by one byte in its file."""
    other = tmp_path / "other"
    shutil.copytree(chunked, other)

    def shift(md: Any) -> None:
        for info in md.storage_data.values():
            info.offset += 1

    _edit_metadata(other, shift)
    return other


def test_a_folder_swapped_while_the_child_parses_cannot_poison_the_cache(
    chunked: Path, tmp_path: Path, in_child: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attacker swaps the checkpoint's folder for another with the same entries while the child
    parses it, and back: the index shown and cached is still the one of the bytes read."""
    other = _other(chunked, tmp_path)
    truth = _summary(chunked)["chunks"]
    for path in _cache_files():
        path.unlink()
    parked = tmp_path / "parked"
    real_start, real_finish = dcp_children.start_child, dcp_children.finish_child

    def start(data: bytes, label: str) -> Any:
        chunked.rename(parked)
        other.rename(chunked)  # what a child opening the path would read
        return real_start(data, label)

    def finish(child: Any, label: str) -> Any:
        try:
            return real_finish(child, label)
        finally:
            chunked.rename(other)
            parked.rename(chunked)  # back: the same inode, size and times as when it was read

    monkeypatch.setattr(dcp_children, "start_child", start)
    monkeypatch.setattr(dcp_children, "finish_child", finish)
    with open_checkpoint(chunked, full_index=True) as ckpt:
        assert {k: ckpt.chunks(k) for k in ckpt.entries} == truth
    monkeypatch.setattr(dcp_children, "start_child", real_start)
    monkeypatch.setattr(dcp_children, "finish_child", real_finish)
    assert len(_cache_files()) == 1
    assert _summary(chunked)["chunks"] == truth  # from the cache


def test_a_file_changed_after_it_was_read_stores_nothing(
    chunked: Path, parses: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    md = chunked / ".metadata"
    real = dcp_metadata.read_keyed

    def read_then_touch(path: Any, label: str) -> Any:
        found = real(path, label)
        st = md.stat()
        os.utime(md, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten meanwhile
        return found

    monkeypatch.setattr(dcp_module, "read_keyed", read_then_touch)
    _summary(chunked)
    assert _cache_files() == []


def test_the_key_holds_the_content(chunked: Path) -> None:
    md = chunked / ".metadata"
    data = md.read_bytes()
    st = os.stat(md)
    a = _index_cache.source_key(md, "dcp-metadata", data, st)
    b = _index_cache.source_key(md, "dcp-metadata", data[:-1] + bytes([data[-1] ^ 1]), st)
    assert a is not None and b is not None and a != b and a["sha256"] != b["sha256"]
    assert _index_cache.store(md, a, b"payload")
    assert _index_cache.load(b) is None and _index_cache.load(a) is not None


def test_cache_files_are_private_and_another_users_are_not_read(chunked: Path, parses: list[str]) -> None:
    _summary(chunked)
    (path,) = _cache_files()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    _summary(chunked)
    assert len(parses) == 1
    path.chmod(0o644)  # readable by others: anyone could have written it
    _summary(chunked)
    assert len(parses) == 2
    (path,) = _cache_files()
    if os.getuid() == 0:  # root can hand the file to another user
        os.chown(path, 65534, 65534)
        _summary(chunked)
        assert len(parses) == 3
        os.chown(path.parent, 65534, 65534)  # the folder too: not read, not written
        path.unlink()
        _summary(chunked)
        _summary(chunked)
        assert len(parses) == 5 and _cache_files() == []


def test_a_symlinked_cache_file_is_not_followed(chunked: Path, parses: list[str], tmp_path: Path) -> None:
    _summary(chunked)
    (path,) = _cache_files()
    planted = tmp_path / "planted.idx"
    planted.write_bytes(path.read_bytes())
    planted.chmod(0o600)
    path.unlink()
    path.symlink_to(planted)
    _summary(chunked)
    assert len(parses) == 2
