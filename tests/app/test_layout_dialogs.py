"""The window's dialogs and layout as a new user met them (issue 25, items 11 and 13): a DCP folder
can be opened and chosen as a destination in the file dialogs; the Convert/Load area folds away;
nothing jumps or is crushed; the path bar keeps both ends of a long path; Values follows the tree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QFileDialog, QLineEdit, QListView
from shiboken6 import isValid

from dcpstudio.core import torch_save_to_dcp
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.tree_model import NAME
from tests.app.test_window import finish, open_by_drop


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, src)
    torch_save_to_dcp(src, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _in_dialog(qtbot: Any, act: Callable[[QFileDialog], None]) -> list[bool]:
    """Runs ``act`` on the file dialog once it is shown; a dialog still open afterwards (it entered
    the folder instead of returning it) is cancelled, so the test ends."""
    state = [False]

    def run() -> None:
        dialog = QApplication.activeModalWidget()
        if not isinstance(dialog, QFileDialog):
            QTimer.singleShot(10, run)
            return
        state[0] = True
        QTimer.singleShot(300, lambda: isValid(dialog) and dialog.isVisible() and dialog.reject())
        act(dialog)

    QTimer.singleShot(0, run)
    return state


def _type_and_enter(name: str) -> Callable[[QFileDialog], None]:
    def act(dialog: QFileDialog) -> None:
        edit = dialog.findChild(QLineEdit, "fileNameEdit")
        edit.setFocus()
        edit.clear()
        QTest.keyClicks(edit, name)
        QTest.keyClick(edit, Qt.Key.Key_Return)

    return act


def _select_and_click(path: Path) -> Callable[[QFileDialog], None]:
    def act(dialog: QFileDialog) -> None:
        dialog.selectFile(str(path))
        box = dialog.findChild(QDialogButtonBox, "buttonBox")
        button = box.button(QDialogButtonBox.StandardButton.Save) or box.button(QDialogButtonBox.StandardButton.Open)
        QTest.qWait(20)  # the queued relabel
        save = dialog.acceptMode() == QFileDialog.AcceptMode.AcceptSave
        assert button.isEnabled() and button.text().replace("&", "") == ("Save" if save else "Open")
        button.click()

    return act


def _double_click(name: str) -> Callable[[QFileDialog], None]:
    def act(dialog: QFileDialog) -> None:
        view = dialog.findChild(QListView, "listView")
        model, root = view.model(), view.rootIndex()
        for _ in range(100):  # the folder is listed in the background
            rows = [model.index(r, 0, root) for r in range(model.rowCount(root))]
            found = [i for i in rows if i.data() == name]
            if found:
                break
            QTest.qWait(10)
        rect = view.visualRect(found[0])
        QTest.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
        QTest.mouseDClick(view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())

    return act


# 11. dialogs ------------------------------------------------------------------------------------------
def test_open_file_opens_a_dcp_folder_typed_or_selected(qtbot: Any, window: MainWindow, dcp_dir: Path) -> None:
    window.settings.add_recent(dcp_dir)  # the dialog starts in the folder holding it
    shown = _in_dialog(qtbot, _type_and_enter(dcp_dir.name))
    assert window.ask_path("Open checkpoint", False) == dcp_dir and shown[0]
    shown = _in_dialog(qtbot, _select_and_click(dcp_dir))
    assert window.ask_path("Open checkpoint", False) == dcp_dir
    shown = _in_dialog(qtbot, _double_click(dcp_dir.name))
    assert window.ask_path("Open checkpoint", False) == dcp_dir
    plain = dcp_dir.parent / "plain"
    plain.mkdir()
    shown = _in_dialog(qtbot, _type_and_enter("plain"))  # a plain folder is entered, as before
    assert window.ask_path("Open checkpoint", False) is None
    shown = _in_dialog(qtbot, _type_and_enter("src.pt"))
    assert window.ask_path("Open checkpoint", False) == dcp_dir.parent / "src.pt"


def test_an_existing_dcp_folder_is_chosen_as_destination_then_confirmed(
    qtbot: Any, window: MainWindow, dcp_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src.pt"
    open_by_drop(qtbot, window, src)
    asked: list[str] = []
    window.confirm = lambda text: asked.append(text) or False  # type: ignore[method-assign]
    _in_dialog(qtbot, _type_and_enter(dcp_dir.name))
    window.panel.convert("dcp")
    assert asked == [f"{dcp_dir} exists. Replace it?"]  # chosen, and the replacement asked about
    _in_dialog(qtbot, _select_and_click(dcp_dir))
    window.panel.convert("dcp")
    assert len(asked) == 2
    window.confirm = lambda text: True  # type: ignore[method-assign]
    _in_dialog(qtbot, _type_and_enter(dcp_dir.name))
    window.panel.convert("dcp")
    finish(qtbot, window, "convert")
    assert window.panel.last_result is not None and window.panel.last_result.dst == dcp_dir


def test_save_dialog_proposes_the_targets_suffix(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.zeros(2)}, src)
    open_by_drop(qtbot, window, src)
    names: list[str] = []

    def read_name(dialog: QFileDialog) -> None:
        names.append(dialog.findChild(QLineEdit, "fileNameEdit").text())
        dialog.reject()

    for target in ("dcp", "torch", "safetensors"):
        _in_dialog(qtbot, read_name)
        assert window.choose_destination(target, src) is None
    assert names == ["src_dcp", "src-1.pt", "src.safetensors"]
    _in_dialog(qtbot, _type_and_enter("typed"))  # a typed name without a suffix gets the target's
    assert window.choose_destination("safetensors", src) == tmp_path / "typed.safetensors"


# 13. layout -------------------------------------------------------------------------------------------
@pytest.fixture
def tensors(tmp_path: Path) -> Path:
    path = tmp_path / "t.pt"
    state = {"flat": torch.randn(3, 3), "cube": torch.randn(4, 5, 6), "five": torch.randn(2, 3, 4, 5, 6), "step": 1}
    torch.save(state, path)
    return path


def _sizes(window: MainWindow) -> tuple[Any, ...]:
    split = window.centralWidget()
    return window.size().toTuple(), split.sizes(), split.widget(2).sizes()


def test_the_convert_area_folds_away_and_the_views_take_its_height(
    qtbot: Any, window: MainWindow, tensors: Path, tmp_path: Path
) -> None:
    window.resize(1400, 860)
    qtbot.wait(20)
    views_height = window.views.height()
    toggle = window.menu_actions["actions_area"]
    assert toggle.isChecked() and toggle.shortcut().toString() == "Ctrl+J"
    toggle.trigger()
    qtbot.wait(20)
    assert not window.actions_tabs.isVisible() and window.views.height() > views_height + 150
    assert not window.settings.actions_shown()
    second = MainWindow()  # remembered
    qtbot.addWidget(second)
    assert not second.right.toggle.isChecked() and not second.actions_tabs.isVisibleTo(second)
    second.close()
    window.right.button.click()  # the corner button of the views does the same
    qtbot.wait(20)
    assert window.actions_tabs.isVisible() and abs(window.views.height() - views_height) <= 2
    toggle.trigger()
    open_by_drop(qtbot, window, tensors)
    window.choose_destination = lambda t, s: tmp_path / "out_dcp"  # type: ignore[method-assign]
    window.panel.convert("dcp")  # a conversion shows the area: its progress and outcome are there
    assert window.actions_tabs.isVisible()
    finish(qtbot, window, "convert")


def test_no_splitter_moves_on_tab_switches_or_exploring_many_dimensions(
    qtbot: Any, window: MainWindow, tensors: Path
) -> None:
    open_by_drop(qtbot, window, tensors)
    for width, height in ((1400, 860), (window.minimumSizeHint().width(), window.minimumSizeHint().height())):
        window.resize(width, height)
        qtbot.wait(30)
        before = _sizes(window)
        for step in (
            lambda: window.views.setCurrentIndex(1),
            lambda: window.views.setCurrentIndex(2),
            lambda: window.explore("cube"),
            lambda: window.explore("five"),
            lambda: window.explore("flat"),
            lambda: window.views.setCurrentIndex(0),
            lambda: window.actions_tabs.setCurrentIndex(1),
            lambda: window.actions_tabs.setCurrentIndex(0),
        ):
            step()
            qtbot.wait(30)
            assert _sizes(window) == before


def test_nothing_is_crushed_at_the_minimum_size(qtbot: Any, window: MainWindow, tensors: Path) -> None:
    open_by_drop(qtbot, window, tensors)
    window.resize(200, 200)  # held at the minimum
    qtbot.wait(30)
    minimum = window.minimumSizeHint()
    assert minimum.width() <= 1280 and minimum.height() <= 760  # a small laptop's screen
    chars = window.fontMetrics().horizontalAdvance("x")
    assert window.browser.width() >= 24 * chars and window.browser.path_bar.width() >= 10 * chars
    assert window.filter_box.width() >= 14 * chars and window.tree_pane.shape_box.width() >= 8 * chars
    for splitter in (window.centralWidget(), window.right):
        assert not splitter.childrenCollapsible() and min(splitter.sizes()) > 0


def test_path_bar_elides_in_the_middle_with_the_full_path_in_its_tooltip(
    qtbot: Any, window: MainWindow, tmp_path: Path
) -> None:
    deep = tmp_path.joinpath(*[f"folder_{i}_with_a_long_name" for i in range(8)])
    deep.mkdir(parents=True)
    window.browser.set_root(str(deep))
    qtbot.wait(20)
    bar = window.browser.path_bar
    shown = bar.shown_text()
    assert bar.text() == str(deep) and str(deep) in bar.toolTip()
    head, tail = shown.split("…")  # both ends kept (a plain line edit shows the end only)
    assert head.startswith("/t") and str(deep).startswith(head) and str(deep).endswith(tail) and tail


def test_values_follow_the_tree_selection_while_shown(qtbot: Any, window: MainWindow, tensors: Path) -> None:
    open_by_drop(qtbot, window, tensors)
    assert window.select("flat")
    window.show_view(1)  # Values, empty: shows the selection
    assert window.explorer.fqn == "flat"
    assert window.select("cube")
    assert window.explorer.fqn == "cube"
    assert window.select("step")  # not a tensor: the tensor stays
    assert window.explorer.fqn == "cube"
    window.show_view(0)
    assert window.select("five")
    assert window.explorer.fqn == "cube"  # Details shown: Values left alone
    window.show_view(1)
    assert window.explorer.fqn == "five"
    window.explore("flat")  # explored from elsewhere (Compare): what is explored is shown
    assert window.explorer.fqn == "flat"


def test_the_name_column_and_the_value_rows_keep_their_room(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    """At the minimum size the tree's Name column keeps 18 characters (the other columns give way,
    elided); at the default size with the Convert area shown, the value table shows 8 rows or more
    (the area starts as small as its pages allow)."""
    path = tmp_path / "deep.pt"
    torch.save({"model": {"layers": {"0": {"attention": {"wq": torch.randn(64, 64)}}}}, "optim": {"lr": 0.1}}, path)
    window.settings.set_actions_shown(True)
    open_by_drop(qtbot, window, path)
    window.resize(200, 200)  # held at the minimum
    qtbot.wait(50)
    chars = window.tree.fontMetrics().horizontalAdvance("x")
    assert window.tree.header().sectionSize(NAME) >= 18 * chars
    window.resize(1400, 860)
    qtbot.wait(50)
    window.explore("model.layers.0.attention.wq")
    table = window.explorer.table
    qtbot.waitUntil(lambda: window.explorer.model.loaded(0, 0), timeout=20_000)
    assert window.right.area.isVisible()
    assert table.viewport().height() >= 8 * table.verticalHeader().defaultSectionSize()
