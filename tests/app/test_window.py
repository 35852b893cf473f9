"""The real window, driven with pytest-qt: open by drop, browse, convert, cancel, errors."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from dcpstudio.core import open_checkpoint, torch_save_to_dcp
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.tree_model import CheckpointTreeModel
from dcpstudio.window.widgets import convert_panel as cp
from tests._gui import Heartbeat
from tests.conftest import assert_same, leftovers, rich_state_dict


def drop(widget: Any, path: Path) -> None:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    event = QDropEvent(
        QPointF(5, 5), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    widget.dropEvent(event)


def open_by_drop(qtbot: Any, window: MainWindow, path: Path) -> None:
    drop(window, path)
    qtbot.waitUntil(lambda: window.ckpt is not None and window.ckpt.path == path, timeout=20_000)


def finish(qtbot: Any, window: MainWindow, kind: str) -> None:
    qtbot.waitUntil(lambda: kind in window.jobs and not window.jobs[kind].running, timeout=60_000)


def test_drop_opens_and_details_follow_selection(qtbot: Any, window: MainWindow, multirank_dcp: Path) -> None:
    open_by_drop(qtbot, window, multirank_dcp)
    assert "dcp" in window.details.summary_title.text() and window.details.by_dtype.rowCount() >= 2
    assert window.select("model.w")
    labels = window.details.prop_labels
    assert labels["Dtype"].text() == "float32" and labels["Shape"].text() == "[10, 6]"
    assert window.details.chunk_table.rowCount() == 3
    qtbot.waitUntil(lambda: "min" in window.details.stats_label.text(), timeout=20_000)
    assert window.details.preview.rowCount() == 10 and window.details.preview.columnCount() == 6
    assert window.details.chunk_table.item(0, 5).text() != ""  # data offsets resolved in the worker
    assert window.select("step")
    assert labels["Kind"].text() == "value"  # until the worker has read it
    qtbot.waitUntil(lambda: labels["Kind"].text() == "value (int)", timeout=20_000)
    window.tree.clearSelection()
    assert window.details.currentIndex() == 0  # summary when nothing is selected
    assert str(multirank_dcp) in window.settings.recent()


def test_filter_box(qtbot: Any, window: MainWindow, multirank_dcp: Path) -> None:
    open_by_drop(qtbot, window, multirank_dcp)
    tree = window.tree_pane.model
    assert tree is not None and tree.rowCount() == 3  # model, step, extra
    window.filter_box.setText("bf")
    qtbot.waitUntil(lambda: tree.rowCount() == 1, timeout=5000)  # once typing pauses
    model_index = tree.index(0, 0)
    assert model_index.data() == "model"
    assert [tree.index(r, 0, model_index).data() for r in range(tree.rowCount(model_index))] == ["bf"]
    window.filter_box.clear()
    qtbot.waitUntil(lambda: tree.rowCount() == 3, timeout=5000)


def test_tree_model_passes_qtmodeltester(qtmodeltester: Any, rich_pt: Path) -> None:
    with open_checkpoint(rich_pt) as ckpt:
        model = CheckpointTreeModel(ckpt.tree, lambda fqn: len(ckpt.chunks(fqn)))
        qtmodeltester.check(model)


def test_convert_with_button_then_verify(qtbot: Any, window: MainWindow, rich_pt: Path, tmp_path: Path) -> None:
    open_by_drop(qtbot, window, rich_pt)
    dst = tmp_path / "out_dcp"
    window.choose_destination = lambda target, src: dst  # type: ignore[method-assign]
    qtbot.mouseClick(window.panel.buttons["dcp"], Qt.MouseButton.LeftButton)
    finish(qtbot, window, "convert")
    assert "out_dcp (dcp)" in window.panel.report.toPlainText()
    assert (dst / ".metadata").is_file()
    qtbot.mouseClick(window.panel.verify_button, Qt.MouseButton.LeftButton)
    finish(qtbot, window, "verify")
    assert window.panel.last_diff is not None and window.panel.last_diff.equal
    assert window.panel.report.toPlainText().startswith("equal")


def test_existing_destination_asks_before_replacing(
    qtbot: Any, window: MainWindow, rich_pt: Path, tmp_path: Path
) -> None:
    open_by_drop(qtbot, window, rich_pt)
    from safetensors.torch import save_file

    dst = tmp_path / "out.safetensors"
    save_file({"precious": torch.ones(3)}, dst)
    before = dst.read_bytes()
    window.choose_destination = lambda target, src: dst  # type: ignore[method-assign]
    asked: list[str] = []
    window.confirm = lambda text: asked.append(text) or False  # type: ignore[method-assign]
    qtbot.mouseClick(window.panel.buttons["safetensors"], Qt.MouseButton.LeftButton)
    assert asked and dst.read_bytes() == before and "convert" not in window.jobs
    window.confirm = lambda text: True  # type: ignore[method-assign]
    qtbot.mouseClick(window.panel.buttons["safetensors"], Qt.MouseButton.LeftButton)
    finish(qtbot, window, "convert")
    with open_checkpoint(dst) as st:
        assert st.format == "safetensors" and "model.w" in st.entries


def test_drop_on_a_target_button_converts_the_dropped_file(
    qtbot: Any, window: MainWindow, rich_pt: Path, tmp_path: Path
) -> None:
    window.choose_destination = lambda target, src: tmp_path / f"{src.stem}_dropped"  # type: ignore[method-assign]
    drop(window.panel.buttons["dcp"], rich_pt)
    finish(qtbot, window, "convert")
    out = tmp_path / "rich_dropped"
    torch_back = tmp_path / "back.pt"
    from dcpstudio.core import dcp_to_torch_save

    dcp_to_torch_save(out, torch_back)
    assert_same(rich_state_dict(), torch.load(torch_back, weights_only=True))


@pytest.fixture
def held_convert(monkeypatch: pytest.MonkeyPatch) -> dict[str, threading.Event]:
    """Conversions pause at their first progress report until released (or cancelled)."""
    events = {"reported": threading.Event(), "release": threading.Event()}
    real = cp.convert

    def convert(src: Any, dst: Any, *, progress: Any, cancel: Any, **kw: Any) -> Any:
        def hold(p: Any) -> None:
            progress(p)
            events["reported"].set()
            while not events["release"].is_set() and not cancel.cancelled:
                time.sleep(0.01)

        return real(src, dst, progress=hold, cancel=cancel, **kw)

    monkeypatch.setattr(cp, "convert", convert)
    return events


def _big(tmp_path: Path) -> Path:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    src = tmp_path / "big.pt"
    torch.save(llama_like_state_dict(8 << 20), src)
    return src


def test_cancel_midway_leaves_nothing(qtbot: Any, window: MainWindow, tmp_path: Path, held_convert: Any) -> None:
    src = _big(tmp_path)
    dst = tmp_path / "cancelled.pt"
    torch_save_to_dcp(src, tmp_path / "src_dcp")
    open_by_drop(qtbot, window, tmp_path / "src_dcp")
    window.choose_destination = lambda target, s: dst  # type: ignore[method-assign]
    qtbot.mouseClick(window.panel.buttons["torch"], Qt.MouseButton.LeftButton)
    assert held_convert["reported"].wait(20)
    assert window.panel.cancel_button.isEnabled()
    qtbot.mouseClick(window.panel.cancel_button, Qt.MouseButton.LeftButton)
    finish(qtbot, window, "convert")
    assert "Cancelled" in window.panel.report.toPlainText()
    assert not dst.exists() and leftovers(tmp_path) == []
    assert all(b.isEnabled() for b in window.panel.buttons.values())


def test_closing_during_a_job_cancels_it(qtbot: Any, tmp_path: Path, held_convert: Any) -> None:
    src = _big(tmp_path)
    w = MainWindow()
    w.show()
    w.choose_destination = lambda target, s: tmp_path / "closing_dcp"  # type: ignore[method-assign]
    job = w.panel.convert("dcp", src)
    assert job is not None and held_convert["reported"].wait(20)
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 10 and not job.is_alive()
    assert not (tmp_path / "closing_dcp").exists() and leftovers(tmp_path) == []


def test_hostile_file_shows_an_explanation_and_offers_trust(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    marker = tmp_path / "RAN"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pt")
    drop(window, tmp_path / "evil.pt")
    qtbot.waitUntil(lambda: window.message_bar.showing, timeout=20_000)
    assert window.message_bar.level == "error" and "could run code" in window.message_bar.text()
    assert [b.text() for b in window.message_bar.buttons] == ["Open trusting this file"]
    assert window.ckpt is None and not marker.exists()
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"PK\x03\x04 not really a zip")
    drop(window, garbage)
    qtbot.waitUntil(lambda: "garbage.pt" in window.message_bar.text(), timeout=20_000)
    assert "Traceback" not in window.message_bar.text()


def test_gui_stays_responsive_during_a_conversion(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    src = tmp_path / "m.pt"
    torch.save(llama_like_state_dict(96 << 20), src)
    torch_save_to_dcp(src, tmp_path / "src_dcp")
    heartbeat = Heartbeat()
    window.choose_destination = lambda target, s: tmp_path / "out.pt"  # type: ignore[method-assign]
    heartbeat.start()
    job = window.panel.convert("torch", tmp_path / "src_dcp")
    assert job is not None
    finish(qtbot, window, "convert")
    heartbeat.stop()
    assert (tmp_path / "out.pt").is_file() and len(heartbeat.gaps) > 5
    assert heartbeat.longest < 0.1, f"GUI thread blocked for {heartbeat.longest * 1000:.0f} ms"


def test_settings_remember_geometry_and_recent(qtbot: Any, rich_pt: Path) -> None:
    w = MainWindow()
    w.show()
    open_by_drop(qtbot, w, rich_pt)
    w.resize(700, 500)  # the window keeps at least its minimum size
    size = (w.size().width(), w.size().height())
    w.close()
    again = MainWindow()
    assert again.settings.recent()[0] == str(rich_pt) and again.settings.last_dir() == str(rich_pt.parent)
    screen = again.screen().availableGeometry()
    if size[0] <= screen.width() and size[1] <= screen.height():
        assert (again.size().width(), again.size().height()) == size
    else:  # a saved size larger than this screen is fitted to it
        assert again.size().width() <= screen.width() and again.size().height() <= screen.height()
    again.close()


def test_file_browser_names_checkpoint_formats(qtbot: Any, rich_pt: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from dcpstudio.window.widgets.file_browser import CheckpointFileModel

    torch_save_to_dcp(rich_pt, tmp_path / "d")
    save_file({"w": torch.ones(1)}, tmp_path / "w.safetensors")
    (tmp_path / "notes.txt").write_text("hello")
    model = CheckpointFileModel()
    assert model.format_of(rich_pt) == "torch.save"
    assert model.format_of(tmp_path / "d") == "DCP"
    assert model.format_of(tmp_path / "w.safetensors") == "safetensors"
    assert model.format_of(tmp_path / "notes.txt") == ""
    sharded = tmp_path / "hf"  # a sharded folder is labelled as its shards are (issue 25, item 14)
    sharded.mkdir()
    save_file({"w": torch.ones(1)}, sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    assert model.format_of(sharded) == "safetensors"


def test_file_browser_orders_numbers_as_numbers_and_folders_first(qtbot: Any, tmp_path: Path) -> None:
    """A run's steps in step order (step-2 before step-10), folders before files."""
    from dcpstudio.window.widgets.file_browser import FileBrowser

    for name in ("step-10", "step-2", "step-1", "Step-3"):
        (tmp_path / name).mkdir()
    (tmp_path / "a.txt").write_text("x")
    browser = FileBrowser(str(tmp_path))
    qtbot.addWidget(browser)
    browser.set_root(str(tmp_path))

    def names() -> list[str]:
        root = browser.view.rootIndex()
        return [str(browser.shown.index(r, 0, root).data()) for r in range(browser.shown.rowCount(root))]

    qtbot.waitUntil(lambda: len(names()) == 5, timeout=5000)
    assert names() == ["step-1", "step-2", "Step-3", "step-10", "a.txt"]
    # a narrow pane elides a name in its middle, so names that differ at their end stay told apart
    assert browser.view.textElideMode() == Qt.TextElideMode.ElideMiddle


def test_errors_from_other_threads_reach_the_message_bar(qtbot: Any, window: MainWindow) -> None:
    import sys

    saved = sys.excepthook, threading.excepthook
    try:
        window.notifier.install_hooks()

        def boom() -> None:
            raise RuntimeError("worker exploded")

        t = threading.Thread(target=boom)
        t.start()
        t.join()
        qtbot.waitUntil(lambda: "worker exploded" in window.message_bar.text(), timeout=5000)
        assert window.message_bar.level == "error"
    finally:
        sys.excepthook, threading.excepthook = saved


def test_demo_opens_the_window_on_generated_checkpoints(
    qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcpstudio.window.main import create_window

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    w = create_window(demo=True)
    qtbot.addWidget(w)
    qtbot.waitUntil(lambda: w.ckpt is not None, timeout=20_000)
    assert w.isVisible() and w.ckpt is not None and w.ckpt.format == "dcp"
    assert w.ckpt.path == tmp_path / "dcpstudio" / "demo" / "demo_dcp"
    assert (tmp_path / "dcpstudio" / "demo" / "demo.pt").is_file()
    assert str(tmp_path / "dcpstudio" / "demo" / "demo.pt") in w.settings.recent()
    w.close()


def test_load_on_ranks_panel(qtbot: Any, window: MainWindow, rich_pt: Path) -> None:
    import multiprocessing

    open_by_drop(qtbot, window, rich_pt)
    window.actions_tabs.setCurrentWidget(window.load_panel)
    window.load_panel.ranks.setValue(2)
    window.load_panel.layout_box.setCurrentText("shard1")
    qtbot.mouseClick(window.load_panel.load_button, Qt.MouseButton.LeftButton)
    assert len(window.load_panel.bars) == 2 and window.load_panel.cancel_button.isEnabled()
    finish(qtbot, window, "load")
    table = window.load_panel.table
    assert table.rowCount() == 2
    assert all(table.item(r, 7).text().startswith("ok") for r in range(2)), [table.item(r, 7).text() for r in range(2)]
    assert table.horizontalHeaderItem(1).text() == "start-up"
    assert all(0 < float(table.item(r, 1).text().removesuffix(" s")) < 120 for r in range(2))
    assert all(bar.value() == 100 for bar in window.load_panel.bars)
    assert "Every shard matches" in window.load_panel.status.text()
    # a cancelled load stops its ranks
    qtbot.mouseClick(window.load_panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(window.load_panel.cancel_button, Qt.MouseButton.LeftButton)
    finish(qtbot, window, "load")
    assert "Cancelled" in window.load_panel.status.text()
    assert multiprocessing.active_children() == []


def test_rapid_selection_changes_cancel_old_previews_safely(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    torch.save(llama_like_state_dict(64 << 20), tmp_path / "m.pt")
    open_by_drop(qtbot, window, tmp_path / "m.pt")
    names = [f"model.layers.{i}.feed_forward.w1.weight" for i in range(8)]
    for name in names:  # each selection replaces a running stats job
        assert window.select(name)
        qtbot.wait(5)
    last = names[-1]
    qtbot.waitUntil(
        lambda: "min" in window.details.stats_label.text() and window.details.current == last, timeout=30_000
    )
    qtbot.waitUntil(lambda: not window.board.retired, timeout=30_000)  # every cancelled job's thread ended
    assert window.details.prop_labels["Name"].text() == last
    assert not window.message_bar.showing  # cancelled jobs report nothing


def test_a_checkpoint_replaced_in_the_window_is_freed(
    qtbot: Any, window: MainWindow, multirank_dcp: Path, rich_pt: Path
) -> None:
    """Minutes of use open one checkpoint after another: the one replaced, with everything its
    finished jobs' callbacks held (previews, statistics), is freed, not kept by those jobs."""
    import gc
    import weakref

    open_by_drop(qtbot, window, multirank_dcp)
    assert window.select("model.w")
    qtbot.waitUntil(lambda: "min" in window.details.stats_label.text(), timeout=20_000)
    first = weakref.ref(window.ckpt)
    for path in (rich_pt, multirank_dcp):
        open_by_drop(qtbot, window, path)
        finish(qtbot, window, "open")
    assert window.select("model.w")
    qtbot.waitUntil(lambda: "min" in window.details.stats_label.text(), timeout=20_000)
    qtbot.wait(50)  # deferred deletions
    gc.collect()
    assert first() is None


def test_split_at_is_refused_for_torch_save_not_ignored(
    qtbot: Any, window: MainWindow, rich_pt: Path, tmp_path: Path
) -> None:
    """'Split at' cannot apply to a torch.save target: said, and nothing is written (issue 25, item 12)."""
    open_by_drop(qtbot, window, rich_pt)
    dst = tmp_path / "out.pt"
    window.choose_destination = lambda target, src: dst  # type: ignore[method-assign]
    window.panel.split.setText("1MB")
    qtbot.mouseClick(window.panel.buttons["torch"], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "torch.save checkpoint is one file" in window.message_bar.text(), timeout=5000)
    assert window.message_bar.level == "error" and not dst.exists()
    assert "convert" not in window.jobs or not window.jobs["convert"].running


def test_show_in_file_manager_says_so_when_no_launcher_starts(
    qtbot: Any, window: MainWindow, rich_pt: Path, monkeypatch: Any
) -> None:
    """Without a launcher (no xdg-open) Qt's openUrl fails: said, not silent (issue 25, item 12)."""
    from PySide6.QtGui import QDesktopServices

    open_by_drop(qtbot, window, rich_pt)
    monkeypatch.setattr(QDesktopServices, "openUrl", staticmethod(lambda url: False))
    assert window.ckpt is not None
    window.show_in_file_manager(window.ckpt.tree)
    assert "No file manager could be started" in window.message_bar.text()
    assert str(rich_pt.parent) in window.message_bar.text()
