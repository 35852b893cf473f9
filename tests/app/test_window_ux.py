"""The window as a demanding user meets it (issue 14): each test is one thing a user saw go wrong
(browser rooting, clipped columns, the filter, casts, same-format conversions, a stale convert
panel, verify, keyboard, messages, drops, details, a jumping layout)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QFont, QGuiApplication
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QFileDialog
from torch.distributed.checkpoint import save as dcp_save

from dcpstudio.core import ConversionResult, open_checkpoint, torch_save_to_dcp
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.tree_model import NAME, TYPE
from dcpstudio.window.widgets import convert_panel as cp
from tests.app.test_window import drop, finish, open_by_drop


@pytest.fixture
def demo(tmp_path: Path) -> tuple[Path, Path]:
    from dcpstudio.core.ops.demo import write_demo

    return write_demo(tmp_path / "demo")


def _wait_filter(qtbot: Any, window: MainWindow) -> None:
    window.tree_pane.apply_filter()  # what the debounce timer does once typing pauses
    qtbot.wait(1)


# 1. the file browser -------------------------------------------------------------------------------
def test_browser_roots_at_the_demo_folder_and_follows_opens(
    qtbot: Any, tmp_path: Path, rich_pt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcpstudio.window.main import create_window

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / ".data"))  # a hidden folder on the way, as ~/.local
    w = create_window(demo=True)
    qtbot.addWidget(w)
    qtbot.waitUntil(lambda: w.ckpt is not None, timeout=30_000)
    demo_dir = tmp_path / ".data" / "dcpstudio" / "demo"
    browser = w.browser
    assert browser.root == str(demo_dir) and browser.path_bar.text() == str(demo_dir)
    current = browser.view.currentIndex()
    assert browser.path_at(current) == demo_dir / "demo_dcp" and browser.view.isExpanded(current)
    qtbot.waitUntil(lambda: browser.shown.rowCount(browser.view.rootIndex()) >= 2, timeout=10_000)
    header = browser.view.header()
    assert header.sectionSize(4) >= header.sectionSizeHint(4)  # "Checkpoint" is not cut
    browser.up_button.click()
    assert browser.root == str(demo_dir.parent) and browser.path_bar.text() == str(demo_dir.parent)
    open_by_drop(qtbot, w, rich_pt)  # opening elsewhere moves the browser there
    assert browser.root == str(rich_pt.parent) and browser.path_at(browser.view.currentIndex()) == rich_pt
    browser.path_bar.setText(str(tmp_path / "no such folder"))
    browser.path_bar.returnPressed.emit()
    assert browser.root == str(rich_pt.parent)  # a bad path changes nothing
    w.close()


def test_a_name_cut_short_in_the_browser_is_read_whole_in_its_tooltip(
    qtbot: Any, window: MainWindow, tmp_path: Path
) -> None:
    window.resize(1400, 860)
    step = tmp_path / "a_run_of_a_long_name" / "step-0000010000"
    dcp_save({"w": torch.ones(2)}, checkpoint_id=step, no_dist=True)
    browser = window.browser
    browser.set_root(str(tmp_path))
    view, fs = browser.view, browser.fs
    for folder in (step.parent, step):
        qtbot.waitUntil(lambda f=folder: browser.shown.mapFromSource(fs.index(str(f))).isValid(), timeout=10_000)
        view.expand(browser.shown.mapFromSource(fs.index(str(folder))))
    qtbot.waitUntil(lambda: fs.rowCount(fs.index(str(step))) >= 2, timeout=10_000)
    for path in (step.parent, step, step / "__0_0.distcp"):
        index = browser.shown.mapFromSource(fs.index(str(path)))
        assert index.data(Qt.ItemDataRole.ToolTipRole) == str(path), path.name
    fmt = browser.shown.mapFromSource(fs.index(str(step))).siblingAtColumn(4)
    assert fmt.data() == "DCP" and fmt.data(Qt.ItemDataRole.ToolTipRole) is None  # the format column: no tooltip


# 2. columns at the default size -----------------------------------------------------------------------
def test_no_tree_column_is_clipped_at_the_default_size(qtbot: Any, window: MainWindow, demo: Any) -> None:
    window.resize(1400, 860)
    open_by_drop(qtbot, window, demo[1])
    window.tree.expandAll()
    qtbot.wait(50)
    header = window.tree.header()
    shown = [c for c in range(header.count()) if not header.isSectionHidden(c)]
    assert {"Shape", "Size"} <= {window.tree_pane.model.headerData(c, Qt.Orientation.Horizontal) for c in shown}
    assert sum(header.sectionSize(c) for c in shown) <= window.tree.viewport().width()
    for c in shown[1:]:
        assert header.sectionSize(c) >= window.tree.sizeHintForColumn(c), window.tree_pane.model.headerData(
            c, Qt.Orientation.Horizontal
        )
    assert header.sectionSize(NAME) >= 140  # and the names keep most of the room


# 3. the filter reveals matches --------------------------------------------------------------------------
def test_filter_reveals_highlights_and_counts_matches(qtbot: Any, window: MainWindow, demo: Any) -> None:
    open_by_drop(qtbot, window, demo[1])
    pane = window.tree_pane
    window.filter_box.setText("wq.weight")
    _wait_filter(qtbot, window)
    assert pane.match_label.text() == "12 of 127 entries match"
    for i in range(12):
        assert window.select(f"model.layers.{i}.attention.wq.weight", scroll=False)
        index = window.tree.currentIndex()
        parent = index.parent()
        while parent.isValid():
            assert window.tree.isExpanded(parent)
            parent = parent.parent()
        font = index.data(Qt.ItemDataRole.FontRole)
        assert isinstance(font, QFont) and font.bold()
    assert pane.model.index(0, TYPE).data() == "12 entries"  # "model" counts the matches, not all 111
    window.filter_box.clear()
    _wait_filter(qtbot, window)
    assert pane.match_label.text() == "127 entries" and pane.model.index(0, TYPE).data() == "111 entries"
    model = window.tree_pane.model
    assert model is not None
    layer0 = model.index_of("model.layers.0")
    assert not window.tree.isExpanded(layer0)  # clearing folds the tree back up...
    assert window.selected_node().path == "model.layers.11.attention.wq.weight"  # ...around the selection
    assert window.tree.isExpanded(model.index_of("model.layers.11.attention"))
    pane.regex_button.setChecked(True)
    window.filter_box.setText(r"layers\.(1|2)\.attention\.w[qk]")
    _wait_filter(qtbot, window)
    assert pane.match_label.text() == "4 of 127 entries match"
    window.filter_box.setText("(")
    _wait_filter(qtbot, window)
    assert pane.match_label.text().startswith("Not a valid pattern")
    assert pane.model.matched == 4  # a bad pattern changes nothing
    pane.regex_button.setChecked(False)
    window.filter_box.clear()
    pane.dtype_box.setCurrentText("float32")
    pane.shape_box.setText("*")
    _wait_filter(qtbot, window)
    with open_checkpoint(demo[1]) as ckpt:
        want = sum(
            1
            for e in ckpt.entries.values()
            if e.kind == "tensor" and e.dtype and e.dtype.name == "float32" and len(e.shape or ()) == 1
        )
    assert pane.model.matched == want > 0


# 4. casts apply to every target ----------------------------------------------------------------------
@pytest.mark.parametrize("target", ["dcp", "torch"])
def test_cast_floats_applies_to_dcp_and_torch_targets(
    qtbot: Any, window: MainWindow, rich_pt: Path, tmp_path: Path, target: str
) -> None:
    open_by_drop(qtbot, window, rich_pt)
    dst = tmp_path / ("out_dcp" if target == "dcp" else "out.pt")
    window.choose_destination = lambda t, s: dst  # type: ignore[method-assign]
    window.panel.dtype.setCurrentText("fp16")
    window.panel.exclude.setText("f8|c64")
    qtbot.mouseClick(window.panel.buttons[target], Qt.MouseButton.LeftButton)
    finish(qtbot, window, "convert")
    assert "cast to fp16" in window.panel.report.toPlainText()
    with open_checkpoint(dst) as out:
        floats = {k: e.dtype.name for k, e in out.entries.items() if e.kind == "tensor" and e.dtype.is_floating_point}
    assert floats and set(floats.values()) == {"float16"}, floats


# 5. same-format conversions, one question, a message said once -----------------------------------------
def test_same_format_conversion_asks_once_and_writes(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "m.safetensors"
    save_file({"keep.w": torch.ones(3), "drop.w": torch.zeros(2)}, src)
    open_by_drop(qtbot, window, src)
    suggestion = cp.suggest_destination("safetensors", src)
    assert suggestion != src and not suggestion.exists()
    asked: list[str] = []
    window.confirm = lambda text: asked.append(text) or True  # type: ignore[method-assign]
    window.choose_destination = lambda t, s: src  # type: ignore[method-assign]
    assert window.panel.convert("safetensors") is None and "another destination" in window.message_bar.text()
    dst = tmp_path / "m2.safetensors"
    save_file({"old": torch.ones(1)}, dst)
    window.choose_destination = lambda t, s: dst  # type: ignore[method-assign]
    window.panel.exclude.setText("^drop")
    window.panel.convert("safetensors")
    finish(qtbot, window, "convert")
    assert len(asked) == 1  # our question only: the file dialog is told not to ask again
    with open_checkpoint(dst) as out:
        assert list(out.entries) == ["keep.w"]
    seen: dict[str, Any] = {}

    def fake_exec(dialog: QFileDialog) -> int:
        seen["asks"] = not dialog.testOption(QFileDialog.Option.DontConfirmOverwrite)
        return 0

    monkeypatch.setattr(QFileDialog, "exec", fake_exec)
    assert window.save_path("t", dst, "") is None and seen == {"asks": False}
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"hello, not a checkpoint at all" * 5)
    drop(window, garbage)
    qtbot.waitUntil(lambda: "garbage.pt" in window.message_bar.text(), timeout=20_000)
    assert window.message_bar.text().lower().count("not a checkpoint") == 1


# 6. the convert panel follows the open checkpoint ---------------------------------------------------------
def test_convert_panel_forgets_another_checkpoints_result(
    qtbot: Any, window: MainWindow, rich_pt: Path, multirank_dcp: Path, tmp_path: Path
) -> None:
    open_by_drop(qtbot, window, rich_pt)
    window.choose_destination = lambda t, s: tmp_path / "out_dcp"  # type: ignore[method-assign]
    window.panel.convert("dcp")
    finish(qtbot, window, "convert")
    assert window.panel.verify_button.isEnabled() and window.panel.report.toPlainText()
    window.panel.open_result()  # opening the result keeps the outcome: Verify is next
    qtbot.waitUntil(lambda: window.ckpt is not None and window.ckpt.path == tmp_path / "out_dcp", timeout=20_000)
    assert window.panel.verify_button.isEnabled() and window.panel.last_result is not None
    open_by_drop(qtbot, window, multirank_dcp)
    assert window.panel.last_result is None and window.panel.report.toPlainText() == ""
    assert not window.panel.verify_button.isEnabled() and not window.panel.open_button.isEnabled()


# 7. verify: cancel, a long report, tolerances, readable numbers ----------------------------------------
def _pair(tmp_path: Path, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> ConversionResult:
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    return ConversionResult(tmp_path / "a.pt", tmp_path / "b.pt", "torch", len(b), 0, 0)


def test_verify_cancels_and_reports_in_a_box_that_does_not_grow(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = {f"t{i}": torch.full((4,), float(i)) for i in range(400)}
    b = {k: v + 1 for k, v in a.items()}
    b["z"] = torch.tensor([0.0, 0.0])
    a["z"] = torch.tensor([0.0, 1.0])  # against 0 in B: no relative error of 1e+300
    window.resize(1200, 800)
    height = window.height()
    window.panel.last_result = _pair(tmp_path, a, b)
    window.panel.verify()
    finish(qtbot, window, "verify")
    text = window.panel.report.toPlainText()
    assert text.count("\n") >= 400 and "e+30" not in text
    assert window.height() == height and window.panel.report.height() == cp.REPORT_HEIGHT
    window.panel.atol.setText("1.5")
    window.panel.verify()
    finish(qtbot, window, "verify")
    assert window.panel.report.toPlainText().startswith("equal")
    window.panel.rtol.setText("lots")
    assert window.panel.verify() is None and "rtol" in window.message_bar.text()
    window.panel.rtol.clear()
    started = threading.Event()
    real = cp.verify

    def held(x: Any, y: Any, *, progress: Any, cancel: Any, **kw: Any) -> Any:
        started.set()
        while not cancel.cancelled:
            time.sleep(0.01)
        return real(x, y, progress=progress, cancel=cancel, **kw)

    monkeypatch.setattr(cp, "verify", held)
    window.panel.verify()
    assert started.wait(20) and window.menu_actions["cancel"].isEnabled()
    window.menu_actions["cancel"].trigger()  # Esc
    finish(qtbot, window, "verify")
    assert window.panel.report.toPlainText() == "Verification cancelled."


# 8. keyboard and menus ---------------------------------------------------------------------------------------
def test_shortcuts_menus_and_about(qtbot: Any, window: MainWindow, demo: Any) -> None:
    keys = {name: a.shortcut().toString() for name, a in window.menu_actions.items()}
    assert keys["open"] == "Ctrl+O" and keys["open_dir"] == "Ctrl+Shift+O" and keys["find"] == "Ctrl+F"
    assert (keys["to_dcp"], keys["to_torch"], keys["to_safetensors"]) == ("Ctrl+1", "Ctrl+2", "Ctrl+3")
    assert keys["cancel"] == "Esc" and keys["compare"] == "Ctrl+D" and keys["explore"] == "Ctrl+E"
    assert keys["verify"] == "Ctrl+Shift+V"
    from dcpstudio.window.menus import about_html, readme_text

    about = about_html()
    assert "0.1.0" in about and torch.__version__.split("+")[0] in about and "Settings" in about
    assert "DCP Studio" in readme_text()
    open_by_drop(qtbot, window, demo[1])
    name = "model.layers.3.attention.wk.weight"
    assert window.select(name)
    window.tree.setFocus()
    QTest.keyClick(window.tree, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)
    assert QGuiApplication.clipboard().text() == name
    window.menu_actions["copy_shape"].trigger()
    assert QGuiApplication.clipboard().text() == "[128, 128]"
    window.menu_actions["find"].trigger()
    assert window.filter_box.hasFocus()


def test_tab_leaves_tables_and_reaches_the_convert_buttons(qtbot: Any, window: MainWindow, demo: Any) -> None:
    open_by_drop(qtbot, window, demo[1])
    window.activateWindow()
    window.tree.setFocus()
    qtbot.waitUntil(window.tree.hasFocus, timeout=5000)
    seen = []
    for _ in range(20):
        QTest.keyClick(QGuiApplication.focusObject(), Qt.Key.Key_Tab)  # type: ignore[arg-type]
        seen.append(QGuiApplication.focusObject())
    assert window.panel.buttons["dcp"] in seen
    assert seen.count(window.details.by_dtype) <= 1  # Tab passes through a table, never cell by cell


def test_context_menu_offers_entry_actions(
    qtbot: Any, window: MainWindow, demo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtGui import QDesktopServices

    from dcpstudio.window.menus import entry_menu

    open_by_drop(qtbot, window, demo[1])
    name = "model.norm.weight"
    assert window.select(name)
    node = window.selected_node()
    menu = entry_menu(window, node)
    titles = [a.text() for a in menu.actions() if a.text()]
    assert titles[:2] == ["Copy full name", "Copy shape"]
    assert {"Explore values", "Export tensor…", "Show in file manager"} <= set(titles)
    opened: list[QUrl] = []
    monkeypatch.setattr(QDesktopServices, "openUrl", staticmethod(lambda url: opened.append(url) or True))
    next(a for a in menu.actions() if a.text() == "Show in file manager").trigger()
    assert [Path(u.toLocalFile()) for u in opened] == [demo[1]]
    next(a for a in menu.actions() if a.text() == "Explore values").trigger()
    assert window.views.currentWidget() is window.explorer and window.explorer.fqn == name


# 9. messages say what to do in the window --------------------------------------------------------------------
def test_pickle_messages_name_window_actions_and_missing_classes(
    qtbot: Any, window: MainWindow, tmp_path: Path
) -> None:
    path = tmp_path / "main_class.pt"
    script = f"import torch\nclass Foo:\n    pass\ntorch.save({{'w': torch.ones(2), 'foo': Foo()}}, {str(path)!r})\n"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    drop(window, path)
    qtbot.waitUntil(lambda: window.message_bar.level == "error", timeout=20_000)
    text = window.message_bar.text()
    assert "--trust-pickle" not in text and "__main__.Foo" in text
    assert [b.text() for b in window.message_bar.buttons] == ["Open trusting this file"]
    window.message_bar.buttons[0].click()
    qtbot.waitUntil(lambda: "needs the class" in window.message_bar.text(), timeout=20_000)
    text = window.message_bar.text()
    assert "__main__.Foo" in text and "saved the file" in text and "Damaged" not in text


# 10. drops copy -----------------------------------------------------------------------------------------------
def test_drops_are_taken_as_a_copy_never_a_move(window: MainWindow, rich_pt: Path) -> None:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(rich_pt))])
    both = Qt.DropAction.CopyAction | Qt.DropAction.MoveAction
    for target in (window, window.panel.buttons["dcp"], window.compare_view):
        enter = QDragEnterEvent(QPoint(5, 5), both, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
        enter.setDropAction(Qt.DropAction.MoveAction)
        target.dragEnterEvent(enter)
        assert enter.isAccepted() and enter.dropAction() == Qt.DropAction.CopyAction
        event = QDropEvent(QPointF(5, 5), both, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
        event.setDropAction(Qt.DropAction.MoveAction)
        window.choose_destination = lambda t, s: None  # type: ignore[method-assign]
        target.dropEvent(event)
        assert event.dropAction() == Qt.DropAction.CopyAction
    window.board.cancel("compare")
    assert window.browser.fs.supportedDragActions() == Qt.DropAction.CopyAction


# 11. details ------------------------------------------------------------------------------------------------------
def test_details_scroll_groups_slices_and_values(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": {"x": torch.arange(1200.0).reshape(20, 3, 4, 5), "y": torch.ones(3)}, "step": 7}, path)
    torch_save_to_dcp(path, tmp_path / "x_dcp")
    open_by_drop(qtbot, window, path)
    assert window.select("a.x")
    bar = window.details.scroll_area.verticalScrollBar()
    qtbot.waitUntil(lambda: window.details.preview_caption.text().startswith("Showing"), timeout=20_000)
    assert window.details.preview_caption.text() == "Showing values[0:12, 0:3, 0, 0] of shape [20, 3, 4, 5]"
    bar.setValue(bar.maximum())
    assert window.select("a.y")
    assert bar.value() == 0  # a new selection starts at the top
    assert window.select("a")
    assert window.details.chunk_table.isHidden() and not window.details.group_table.isHidden()
    kinds = []
    for source in (path, tmp_path / "x_dcp"):
        open_by_drop(qtbot, window, source)
        assert window.select("step")
        label = window.details.prop_labels["Kind"]
        qtbot.waitUntil(lambda label=label: label.text().startswith("value ("), timeout=20_000)
        kinds.append((label.text(), window.details.prop_labels["Size"].text()))
    assert kinds == [("value (int)", ""), ("value (int)", "")]  # the same value reads the same in both formats


def test_histogram_has_axes_and_counts(qtbot: Any) -> None:
    from dcpstudio.window.widgets.drawing import Histogram

    h = Histogram()
    qtbot.addWidget(h)
    h.resize(400, 160)
    h.show()
    qtbot.waitExposed(h)
    h.set_data([0.0, 1.0, 2.0, 3.0, 4.0], [5, 50, 500, 7])
    image = h.grab().toImage()
    assert image.pixelColor(int(h.left_margin), 80).name() != image.pixelColor(2, 2).name()  # the count axis
    x = h.left_margin + (400 - h.left_margin - 8) * 2.5 / 4
    assert h.bin_at(x) == 2
    QTest.mouseMove(h, QPoint(int(x), 80))
    qtbot.waitUntil(lambda: h.toolTip() != "", timeout=2000)
    assert h.toolTip() == "[2, 3): 500 values"


# 12. the layout does not jump ------------------------------------------------------------------------------
def test_messages_and_busy_states_do_not_move_the_buttons(qtbot: Any, window: MainWindow) -> None:
    window.resize(1400, 860)
    qtbot.wait(20)
    button = window.panel.buttons["safetensors"]

    def where() -> tuple[int, int, int, int]:
        p = button.mapTo(window, QPoint(0, 0))
        return p.x(), p.y(), button.width(), button.height()

    before = where()
    window.notifier.error(RuntimeError("x" * 400), [("Do something", lambda: None)])
    qtbot.wait(20)
    assert where() == before
    window.panel.set_busy(True, "working")
    qtbot.wait(20)
    assert where() == before
    window.panel.set_busy(False)
    window.message_bar.clear()
    qtbot.wait(20)
    assert where() == before


def test_read_me_shows_no_broken_picture_and_no_sideways_scrolling(qtbot: Any, window: MainWindow) -> None:
    """The README's pictures are not installed: their captions show instead; code lines wrap at the
    dialog's width (issue 25, item 14)."""
    from PySide6.QtWidgets import QTextBrowser

    from dcpstudio.window.menus import show_readme

    dialog = show_readme(window)
    qtbot.addWidget(dialog)
    view = dialog.findChild(QTextBrowser)
    assert view is not None
    assert "<img" not in view.toHtml() and "(picture: " in view.toPlainText()
    qtbot.waitUntil(lambda: view.document().size().width() > 0, timeout=5000)
    assert view.horizontalScrollBar().maximum() == 0
    dialog.close()
