"""Start-up (issue 25, item 15): the tree of the demo, or of a checkpoint named on the command line,
is shown before PyTorch is imported -- opening needs no torch, and torch's import, holding the GIL
for seconds, starts only once the tree is there. Each run is a fresh child process, so that
``sys.modules`` says what the window imported, not what the test suite did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcpstudio.core.ops.demo import demo_dir, write_demo, written_demo

CHILD = r"""
import json, os, sys, time
from PySide6.QtWidgets import QApplication
app = QApplication([])
from dcpstudio.window import main_window
from dcpstudio.window.main import create_window
from dcpstudio.window.widgets.tree_pane import TreePane
seen = {}
slow = float(os.environ.get("SLOW_OPEN", "0"))  # a large or remote checkpoint: opening takes a while
opener = main_window.open_checkpoint
main_window.open_checkpoint = lambda *a, **k: (time.sleep(slow), opener(*a, **k))[1]
show = TreePane.show_checkpoint
def spy(self, ckpt, index=None):
    seen.setdefault("torch_before_tree", "torch" in sys.modules)
    seen.setdefault("shown", str(ckpt.path))
    show(self, ckpt, index)
TreePane.show_checkpoint = spy
w = create_window(sys.argv[1:], demo=not sys.argv[1:])
deadline = time.monotonic() + 60
while not ("shown" in seen and "torch" in w.jobs) and time.monotonic() < deadline:
    app.processEvents()
    time.sleep(0.005)
seen["torch_started_after"] = "torch" in w.jobs
seen["rows"] = w.tree_pane.model.rowCount() if w.tree_pane.model else 0
seen["pyqtgraph"] = "pyqtgraph" in sys.modules  # the Run view's plots: imported with the first run
print(json.dumps(seen), flush=True)
os._exit(0)  # not waiting for torch's import to end
"""


def _launch(tmp_path: Path, *args: str, slow: float = 0.0) -> dict[str, object]:
    env = {
        **os.environ,
        "SLOW_OPEN": str(slow),
        "QT_QPA_PLATFORM": "offscreen",
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture
def written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The demo as an earlier launch left it, in the data folder the child uses."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return write_demo(demo_dir())


def test_demo_written_before_shows_its_tree_before_torch_is_imported(
    tmp_path: Path, written: tuple[Path, Path]
) -> None:
    seen = _launch(tmp_path)
    assert seen["shown"] == str(written[1]) and seen["rows"]
    assert seen["torch_before_tree"] is False
    assert seen["torch_started_after"] is True  # previews and statistics still get it, in the background
    assert seen["pyqtgraph"] is False


def test_a_slow_open_on_the_command_line_shows_its_tree_before_torch_is_imported(
    tmp_path: Path, written: tuple[Path, Path]
) -> None:
    """The import waits for the checkpoint asked for, however long it takes to open (it was started
    50 ms after the first paint, sharing the GIL with the opening from then on)."""
    seen = _launch(tmp_path, str(written[0]), slow=0.5)
    assert seen["shown"] == str(written[0]) and seen["rows"]
    assert seen["torch_before_tree"] is False
    assert seen["torch_started_after"] is True


def test_the_demo_is_written_again_when_anything_in_it_changed(tmp_path: Path) -> None:
    """The stamp is what lets a launch skip writing: a file changed, added or removed since, another
    version's stamp, or a half-written demo (no stamp) means writing it again."""
    directory = tmp_path / "demo"
    assert written_demo(directory) is None
    pt, dcp_dir = write_demo(directory)
    assert written_demo(directory) == (pt, dcp_dir)
    shard = next(dcp_dir.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, new mtime
    os.utime(shard, ns=(0, 0))
    assert written_demo(directory) is None
    write_demo(directory)
    (dcp_dir / "extra").write_text("x")
    assert written_demo(directory) is None
    write_demo(directory)
    pt.unlink()
    assert written_demo(directory) is None
    write_demo(directory)
    stamp = directory / ".demo-stamp.json"
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "version": -1}))
    assert written_demo(directory) is None
    stamp.write_text("{not json")
    assert written_demo(directory) is None


def test_a_checkpoint_opened_while_torch_is_being_imported_is_read(
    tmp_path: Path, written: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background import puts a half-built ``torch`` in ``sys.modules`` for seconds; a checkpoint
    opened meanwhile (the user does not wait for it) was refused with "partially initialized module
    'torch' has no attribute 'Tensor'" from the checks that ask whether a value is torch's."""
    import types

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.dtypes import dtype_of
    from dcpstudio.window.menus import about_html

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # as early in its import
    for path in written:
        with open_checkpoint(path) as ckpt:
            assert sorted(ckpt.tree.children) == ["config", "model", "optim", "step"]
    assert dtype_of("float32") != object()
    assert "PyTorch" in about_html()
