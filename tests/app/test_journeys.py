"""Two whole journeys through the window, as a user makes them (issue 25, "Done when"): open →
filter → explore → compare → convert to each target with an include pattern and a bf16 cast →
Verify through the conversion's transform → Load on 2 ranks. One is made with the keyboard only
(shortcuts, Tab, arrows, Return, Space to the focused widget), the other with the mouse only
(clicks on buttons, rows, tabs, menu items; typing a pattern into a field the mouse chose is the
one thing a mouse cannot do). File dialogs are answered by replacing the window's dialog methods.
What is checked is what a user sees -- labels, table cells, the report, the clipboard -- and the
files written, read back by torch's own readers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PySide6.QtCore import QModelIndex, Qt, QTimer
from PySide6.QtGui import QContextMenuEvent, QGuiApplication
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QAbstractItemView, QApplication, QMenu, QPushButton, QWidget

from dcpstudio.window.main_window import MainWindow
from tests.app.test_window import finish

CHANGED = "model.layers.7.w3"  # the entry B changes, and the one explored
INCLUDE = r"^model\."
LEFT, RIGHT = Qt.MouseButton.LeftButton, Qt.MouseButton.RightButton
CTRL, SHIFT = Qt.KeyboardModifier.ControlModifier, Qt.KeyboardModifier.ShiftModifier
NONE = Qt.KeyboardModifier.NoModifier
DEFAULT_SIZE = (1400, 860)  # the window's own; offscreen's 800x800 screen would shrink it to its minimum


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A (1,005 entries: 1,000 model tensors, 4 optimizer tensors, a step) and B, which differs
    from A in :data:`CHANGED` only."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        f"model.layers.{i}.w{j}": torch.randn(8, 6, generator=g) for i in range(100) for j in range(10)
    }
    state.update({f"optim.m.{i}": torch.randn(4, generator=g) for i in range(4)})
    state["step"] = 7
    torch.save(state, tmp_path / "a.pt")
    torch.save({**state, CHANGED: state[CHANGED] + 1}, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt", state


def _outputs(tmp_path: Path) -> dict[str, Path]:
    return {"dcp": tmp_path / "out_dcp", "torch": tmp_path / "out.pt", "safetensors": tmp_path / "out.safetensors"}


def _read_back(target: str, dst: Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What torch's own reader of ``target`` reads from ``dst``, every entry it holds."""
    if target == "torch":
        return dict(torch.load(dst, weights_only=True))
    if target == "safetensors":
        from safetensors.torch import load_file

        return load_file(dst)
    import torch.distributed.checkpoint as dcp

    names = list(dcp.FileSystemReader(dst).read_metadata().state_dict_metadata)
    out = {
        k: torch.empty(state[k].shape, dtype=torch.bfloat16) for k in names if isinstance(state.get(k), torch.Tensor)
    }
    dcp.load(out, checkpoint_id=dst, no_dist=True)
    assert set(out) == set(names), names  # nothing but tensors written
    return out


def _check_output(target: str, dst: Path, state: dict[str, Any]) -> None:
    got = _read_back(target, dst, state)
    want = {k: v.to(torch.bfloat16) for k, v in state.items() if k.startswith("model.")}
    assert sorted(got) == sorted(want), target  # the included entries only
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), (target, k)


def _check_verified(window: MainWindow) -> None:
    lines = window.panel.report.toPlainText().splitlines()
    assert lines[0] == "equal: 1,000 entries compared", lines
    assert lines[1] == rf"A is the source through --include '{INCLUDE}' --dtype bf16: 1,000 of 1,005 entries", lines
    assert window.panel.outcome.state == "ok"


def _check_loaded(window: MainWindow) -> None:
    table = window.load_panel.table
    assert table.rowCount() == 2
    checks = [table.item(r, 7).text() for r in range(2)]
    assert all(c.startswith("ok (") and c.endswith(" entries)") for c in checks), checks
    assert [table.item(r, 0).text() for r in range(2)] == ["0", "1"]
    assert window.load_panel.status.text() == "Every shard matches the source."


# -- the keyboard only ----------------------------------------------------------------------------------
def _keys(*presses: Any) -> None:
    """Each press (a key, or a key and its modifiers) to the widget that has the focus."""
    for press in presses:
        key, mods = press if isinstance(press, tuple) else (press, NONE)
        QTest.keyClick(QGuiApplication.focusObject(), key, mods)  # type: ignore[arg-type]


def _tab_to(widget: QWidget, limit: int = 60) -> int:
    """Press Tab until ``widget`` has the focus; how many presses it took (at most ``limit``)."""
    for n in range(1, limit + 1):
        _keys(Qt.Key.Key_Tab)
        if widget.hasFocus():
            return n
    raise AssertionError(f"Tab never reached {widget!r}; stopped at {QGuiApplication.focusObject()!r}")


def test_the_whole_journey_with_the_keyboard_only(
    qtbot: Any, window: MainWindow, pair: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, state = pair
    w3 = state[CHANGED]
    window.resize(*DEFAULT_SIZE)
    window.activateWindow()
    window.tree.setFocus()
    qtbot.waitUntil(lambda: QGuiApplication.focusObject() is not None, timeout=5000)
    monkeypatch.setattr(window, "ask_path", lambda title, directory: a)  # the file dialog, answered
    _keys((Qt.Key.Key_O, CTRL))  # File › Open
    qtbot.waitUntil(lambda: window.ckpt is not None, timeout=20_000)
    assert window.tree_pane.match_label.text() == "1,005 entries"

    _keys((Qt.Key.Key_F, CTRL))  # Find
    assert window.filter_box.hasFocus()
    QTest.keyClicks(window.filter_box, "layers.7.w3")
    qtbot.waitUntil(lambda: window.tree_pane.match_label.text() == "1 of 1,005 entries match", timeout=5000)
    assert _tab_to(window.tree) == 5  # past .*, dtype, shape and the filter pin
    _keys(Qt.Key.Key_Down, Qt.Key.Key_Down, Qt.Key.Key_Down, Qt.Key.Key_Down)  # model, layers, 7, w3
    assert window.selected_node().path == CHANGED

    _keys((Qt.Key.Key_E, CTRL))  # Explore values
    explorer = window.explorer
    assert explorer.table.hasFocus() and explorer.fqn == CHANGED
    assert window.views.tabText(window.views.currentIndex()) == "Values"
    assert explorer.title.text().startswith(CHANGED)
    qtbot.waitUntil(lambda: explorer.model.loaded(0, 0), timeout=20_000)
    assert explorer.model.index(0, 1).data() == f"{w3[0, 1].item():.6g}"  # as torch reads it
    _keys(Qt.Key.Key_Right, (Qt.Key.Key_Right, SHIFT), (Qt.Key.Key_C, CTRL))
    finish(qtbot, window, "explore-copy")
    assert [float(v) for v in QGuiApplication.clipboard().text().split(",")] == w3[0, 1:3].tolist()

    _keys((Qt.Key.Key_3, Qt.KeyboardModifier.AltModifier))  # the Compare view
    view = window.compare_view
    assert view.b_path.hasFocus()
    QTest.keyClicks(view.b_path, str(b))
    _keys(Qt.Key.Key_Return)
    finish(qtbot, window, "compare")
    assert view.summary.text() == "1,005 entries: 1,004 equal, 1 different"
    shown = {view.proxy.index(r, 0).data(): view.proxy.index(r, 1).data() for r in range(view.proxy.rowCount())}
    assert len(shown) == 1005 and [k for k, s in shown.items() if s != "equal"] == [CHANGED]
    assert shown[CHANGED] == "different"

    panel = window.panel
    _tab_to(panel.include)
    QTest.keyClicks(panel.include, INCLUDE)
    _tab_to(panel.dtype)
    _keys(Qt.Key.Key_Down)  # keep dtypes → bf16
    assert panel.dtype.currentText() == "bf16"
    outputs = _outputs(tmp_path)
    monkeypatch.setattr(window, "choose_destination", lambda target, src: outputs[target])  # the save dialog
    for key, target in ((Qt.Key.Key_1, "dcp"), (Qt.Key.Key_2, "torch"), (Qt.Key.Key_3, "safetensors")):
        _keys((key, CTRL))  # Convert › To …
        finish(qtbot, window, "convert")
        assert panel.report.toPlainText().startswith(f"Wrote {outputs[target]} ({target}): 1,000 tensors"), target
        assert "cast to bf16" in panel.report.toPlainText()
        _check_output(target, outputs[target], state)
        _keys((Qt.Key.Key_V, CTRL | SHIFT))  # Verify
        finish(qtbot, window, "verify")
        _check_verified(window)

    _keys((Qt.Key.Key_L, CTRL | SHIFT))  # Load on ranks
    load = window.load_panel
    assert load.ranks.hasFocus() and load.ranks.value() == 2
    _keys(Qt.Key.Key_Up, Qt.Key.Key_Down)
    assert load.ranks.text() == "2"
    _tab_to(load.load_button)
    _keys(Qt.Key.Key_Space)
    assert len(load.bars) == 2
    finish(qtbot, window, "load")
    _check_loaded(window)


# -- the mouse only -------------------------------------------------------------------------------------
def _click_row(
    qtbot: Any, view: QAbstractItemView, index: QModelIndex, button: Any = LEFT, *, double: bool = False
) -> None:
    view.scrollTo(index)
    qtbot.waitUntil(lambda: view.visualRect(index).isValid(), timeout=10_000)
    where = view.visualRect(index).center()
    QTest.mouseClick(view.viewport(), button, NONE, where)
    if button == RIGHT:  # what the windowing system makes of a right click; QTest does not
        menu = QContextMenuEvent(QContextMenuEvent.Reason.Mouse, where, view.viewport().mapToGlobal(where))
        QApplication.sendEvent(view.viewport(), menu)
    if double:  # the second click of a double click: QTest's double click alone is lost on a first press
        QTest.mouseDClick(view.viewport(), button, NONE, where)


def _click_tab(tabs: Any, title: str) -> None:
    bar = tabs.tabBar()
    n = next(i for i in range(bar.count()) if bar.tabText(i) == title)
    QTest.mouseClick(bar, LEFT, NONE, bar.tabRect(n).center())
    assert tabs.tabText(tabs.currentIndex()) == title


def _click(widget: QWidget) -> None:
    assert widget.isVisible() and widget.isEnabled(), widget
    QTest.mouseClick(widget, LEFT, NONE, widget.rect().center())


def _click_menu_item_when_shown(text: str) -> tuple[QTimer, list[str]]:
    """Click ``text`` in the next menu shown (a menu's exec() blocks: a timer clicks), and the
    titles that menu offered; keep the timer until the menu was used."""
    offered: list[str] = []
    timer = QTimer()

    def look() -> None:
        menu = QApplication.activePopupWidget()
        if not isinstance(menu, QMenu):
            return
        timer.stop()
        offered.extend(a.text() for a in menu.actions() if a.text())
        action = next(a for a in menu.actions() if a.text() == text)
        QTest.mouseClick(menu, LEFT, NONE, menu.actionGeometry(action).center())

    timer.setInterval(20)
    timer.timeout.connect(look)
    timer.start()
    return timer, offered


def _button(parent: QWidget, text: str) -> QPushButton:
    return next(b for b in parent.findChildren(QPushButton) if b.text() == text)


def test_the_whole_journey_with_the_mouse_only(
    qtbot: Any, window: MainWindow, pair: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, state = pair
    w3 = state[CHANGED]
    window.resize(*DEFAULT_SIZE)
    browser = window.browser
    browser.set_root(str(tmp_path))  # the folder the user browsed to
    qtbot.waitUntil(lambda: browser._index(str(a)).isValid(), timeout=10_000)
    _click_row(qtbot, browser.view, browser._index(str(a)), double=True)  # open
    qtbot.waitUntil(lambda: window.ckpt is not None, timeout=20_000)
    assert window.ckpt.path == a and window.tree_pane.match_label.text() == "1,005 entries"

    tree, model = window.tree, window.tree_pane.model
    assert model is not None
    for group in ("model", "model.layers", "model.layers.7"):
        _click_row(qtbot, tree, model.index_of(group), double=True)  # a double click unfolds a group
        assert tree.isExpanded(model.index_of(group)), group
    timer, offered = _click_menu_item_when_shown("Filter to this name")
    _click_row(qtbot, tree, model.index_of(CHANGED), RIGHT)  # the entry's menu › Filter to this name
    qtbot.waitUntil(lambda: window.tree_pane.match_label.text() == "1 of 1,005 entries match", timeout=5000)
    timer.stop()
    assert "Explore values" in offered and window.filter_box.text() == CHANGED
    assert window.selected_node().path == CHANGED

    _click_tab(window.views, "Values")  # Values shows the tensor selected in the tree
    explorer = window.explorer
    qtbot.waitUntil(lambda: explorer.fqn == CHANGED and explorer.model.loaded(0, 0), timeout=20_000)
    cell = explorer.model.index(2, 4)
    assert cell.data() == f"{w3[2, 4].item():.6g}"
    _click_row(qtbot, explorer.table, cell)
    _click(explorer.copy_button)
    finish(qtbot, window, "explore-copy")
    assert float(QGuiApplication.clipboard().text()) == w3[2, 4].item()

    _click_tab(window.views, "Compare")
    view = window.compare_view
    monkeypatch.setattr(window, "ask_path", lambda title, directory: b)  # the file dialog, answered
    _click(_button(view, "Browse…"))  # chooses B and compares
    finish(qtbot, window, "compare")
    assert view.b_path.text() == str(b)
    assert view.summary.text() == "1,005 entries: 1,004 equal, 1 different"
    _click(view.differences)
    assert view.differences.isChecked() and view.proxy.rowCount() == 1
    assert (view.proxy.index(0, 0).data(), view.proxy.index(0, 1).data()) == (CHANGED, "different")

    panel = window.panel
    _click(panel.include)
    QTest.keyClicks(panel.include, INCLUDE)  # a pattern is typed, whatever points at the field
    _click(panel.dtype)
    popup = panel.dtype.view()
    qtbot.waitUntil(popup.isVisible, timeout=5000)
    qtbot.wait(QGuiApplication.styleHints().mouseDoubleClickInterval() + 50)  # a popup takes no click sooner
    _click_row(qtbot, popup, popup.model().index(1, 0))
    qtbot.waitUntil(lambda: not popup.isVisible(), timeout=5000)
    assert panel.dtype.currentText() == "bf16"
    outputs = _outputs(tmp_path)
    monkeypatch.setattr(window, "choose_destination", lambda target, src: outputs[target])  # the save dialog
    for target in ("dcp", "torch", "safetensors"):
        _click(panel.buttons[target])
        finish(qtbot, window, "convert")
        assert panel.report.toPlainText().startswith(f"Wrote {outputs[target]} ({target}): 1,000 tensors"), target
        _check_output(target, outputs[target], state)
        _click(panel.verify_button)
        finish(qtbot, window, "verify")
        _check_verified(window)

    _click_tab(window.actions_tabs, "Load on ranks")
    load = window.load_panel
    assert load.ranks.value() == 2
    _click(load.load_button)
    assert len(load.bars) == 2
    finish(qtbot, window, "load")
    _check_loaded(window)
