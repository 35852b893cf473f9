"""A large DCP in the window: its tree is shown from the ``.metadata``'s head while a child process
reads the storage index; a tensor selected meanwhile gets its chunk table when the index is in; a
checkpoint whose whole metadata contradicts its head is closed with the refusal."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import pytest

from dcpstudio.core.checkpoints.dcp import checkpoint as dcp_module
from dcpstudio.core.checkpoints.dcp import metadata as dcp_metadata
from dcpstudio.window.main_window import MainWindow
from tests.app.test_window import drop
from tests.core.test_fast_metadata import _frames, framed
from tests.perf import big_metadata


@pytest.fixture
def held_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> threading.Event:
    """The child's index is taken only once the returned event is set; an empty index cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gate = threading.Event()
    real = dcp_module.finish_child

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_module, "finish_child", held)
    return gate


def _big(tmp_path: Path) -> Path:
    folder = tmp_path / "big"
    folder.mkdir()
    big_metadata.write_metadata(folder / ".metadata", 12_000, 4, rows=16, cols=64)  # ~8 MiB: read from its head
    assert (folder / ".metadata").stat().st_size > dcp_metadata.HEAD_ONLY_ABOVE
    return folder


def test_the_tree_comes_from_the_head_and_chunks_follow_the_index(
    qtbot: Any, window: MainWindow, tmp_path: Path, held_index: threading.Event
) -> None:
    folder = _big(tmp_path)
    drop(window, folder)
    qtbot.waitUntil(lambda: window.ckpt is not None, timeout=30_000)
    ckpt = window.ckpt
    assert ckpt is not None and not ckpt.index_ready()  # the tree is shown; the index is still held back
    assert window.tree_pane.model is not None and window.tree_pane.model.total == 12_000
    assert "12,000 tensors" in window.details.summary_title.text()
    name = big_metadata.name(777)
    assert window.select(name)  # on the GUI thread, without waiting for the index
    assert window.details.prop_labels["Shape"].text() == "[64, 64]"
    assert window.details.chunk_table.rowCount() == 0 and window.jobs["index"].running
    held_index.set()
    qtbot.waitUntil(lambda: window.details.chunk_table.rowCount() == 4, timeout=60_000)
    assert ckpt.index_ready()
    assert window.details.chunk_table.item(3, 0).text() == "[48, 0]"
    assert window.select(big_metadata.name(778)) and window.details.chunk_table.rowCount() == 4


def test_a_head_the_whole_contradicts_is_closed_with_the_refusal(
    qtbot: Any, window: MainWindow, tmp_path: Path, held_index: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries set twice: the head names one set, the whole stream another (see test_fast_metadata)."""
    monkeypatch.setattr(dcp_metadata, "HEAD_ONLY_ABOVE", 0)  # a small one read as a large one
    monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0)
    data = pickle.dumps(big_metadata.torch_metadata(300, 2))
    payload = b"".join(data[a + 9 : b] for a, b in _frames(data))
    assert payload.endswith(b"ub.")
    folder = tmp_path / "twice"
    folder.mkdir()
    (folder / ".metadata").write_bytes(framed(payload[:-3] + b"\x8c\x13state_dict_metadata}u" + b"b."))
    drop(window, folder)
    qtbot.waitUntil(lambda: window.ckpt is not None, timeout=30_000)
    assert window.tree_pane.model is not None and window.tree_pane.model.total == 300
    held_index.set()
    qtbot.waitUntil(lambda: window.ckpt is None and window.message_bar.showing, timeout=60_000)
    assert "set twice" in window.message_bar.text() and window.tree_pane.model is None
