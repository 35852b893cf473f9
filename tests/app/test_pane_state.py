"""Issue 25, items 8-10: what a pane shows follows the open checkpoint (nothing stale), every job
ends in a result or an error shown where it was asked for (nothing stuck), and the same thing is
numbered and named the same everywhere."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
from PySide6.QtCore import Qt
from safetensors.torch import save_file

from dcpstudio.core import torch_save_to_dcp
from dcpstudio.core.ranks.launch import LaunchError, RankProgress
from dcpstudio.core.ranks.load import RankReport
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.tree_model import TYPE
from dcpstudio.window.widgets import load_panel

BACKGROUND = Qt.ItemDataRole.BackgroundRole


def _open(qtbot: Any, window: MainWindow, path: Path) -> None:
    window.open_path(path)
    qtbot.waitUntil(lambda: window.ckpt is not None and window.ckpt.path == path, timeout=20_000)


def _finish(qtbot: Any, window: MainWindow, kind: str) -> None:
    qtbot.waitUntil(lambda: kind in window.jobs and not window.jobs[kind].running, timeout=20_000)


def _fake_load(reports: list[RankReport] | None = None, error: Exception | None = None) -> Any:
    """run_load's stand-in: two ranks report progress, then it returns ``reports`` or raises."""

    def run(path: Any, *, ranks: int, layout: str, mesh: Any, on_progress: Any, cancel: Any) -> list[RankReport]:
        for rank, stage, fraction in ((0, "planned", 0.1), (1, "planned", 0.1), (0, "loaded", 0.7), (1, "loaded", 0.7)):
            on_progress(RankProgress(rank, stage, fraction))
        time.sleep(0.3)  # the window shows the ranks at 70 % meanwhile
        if error is not None:
            raise error
        return reports or []

    return run


def test_opening_another_checkpoint_resets_load_filter_goto_and_compare(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: Any
) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.arange(100.0).reshape(10, 10), "bias": torch.ones(3)}, a)
    torch.save({"x": torch.ones(4, 4), "y": torch.zeros(2)}, b)
    _open(qtbot, window, a)
    report = RankReport(0, 0.1, 0, 0, 400, 1 << 20, 2)
    monkeypatch.setattr(load_panel, "run_load", _fake_load([report, RankReport(1, 0.1, 0, 0, 400, 1 << 20, 2)]))
    window.load_panel.load()
    _finish(qtbot, window, "load")
    assert window.load_panel.table.rowCount() == 2
    window.filter_to("w")
    assert window.tree_pane.match_label.text() == "1 of 2 entries match"
    window.explore("w")
    window.explorer.go_to(5, 7)
    assert (window.explorer.goto_row.value(), window.explorer.goto_col.value()) == (5, 7)
    window.compare_view.run(b)
    _finish(qtbot, window, "compare")
    assert window.compare_view.progress.text() == "100%"  # finished: not "0%"
    window.load_panel.load()  # still running when b is opened: stopped, and says nothing about a

    _open(qtbot, window, b)
    _finish(qtbot, window, "load")
    panel = window.load_panel
    assert panel.table.rowCount() == 0 and not panel.bars and panel.status.text() == ""
    assert window.filter_box.text() == "" and window.tree_pane.match_label.text() == "2 entries"
    window.explore("x")
    assert (window.explorer.goto_row.value(), window.explorer.goto_col.value()) == (0, 0)
    assert window.compare_view.progress.text() == ""  # nothing compared with b yet

    window.tree_pane.pin_button.setChecked(True)  # kept by choice, and remembered
    assert window.settings.keep_filter()
    window.filter_to("x")
    _open(qtbot, window, a)
    assert window.filter_box.text() == "x" and window.tree_pane.match_label.text() == "0 of 2 entries match"


def test_a_read_that_fails_is_shown_in_the_pane_with_retry(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    src, dcp, away = tmp_path / "x.pt", tmp_path / "x_dcp", tmp_path / "away"
    torch.save({"w": torch.arange(48.0).reshape(6, 8)}, src)
    torch_save_to_dcp(src, dcp)
    _open(qtbot, window, dcp)
    away.mkdir()
    for f in dcp.glob("*.distcp"):
        shutil.move(f, away / f.name)  # the data files are missing
    assert window.select("w")
    details = window.details
    qtbot.waitUntil(lambda: details.read_error.isVisible(), timeout=20_000)
    assert details.read_error.text().startswith("Not read: ") and details.preview_caption.text() != "reading…"
    window.explore("w")
    explorer = window.explorer
    qtbot.waitUntil(lambda: explorer.read_error.isVisible(), timeout=20_000)
    _finish(qtbot, window, "explore-summary")
    assert "summarising" not in explorer.summary_label.text()
    assert explorer.read_error.retry_button.isVisible()
    for f in away.iterdir():
        shutil.move(f, dcp / f.name)  # put back: Retry reads them
    explorer.read_error.retry_button.click()
    qtbot.waitUntil(lambda: explorer.summary is not None, timeout=20_000)
    assert not explorer.read_error.isVisible(), explorer.read_error.text()
    window.views.setCurrentWidget(details)
    details.read_error.retry_button.click()
    qtbot.waitUntil(lambda: details.preview_caption.text().startswith("Showing"), timeout=20_000)
    assert not details.read_error.isVisible()


def test_load_panel_follows_the_ranks_and_fails_in_place(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: Any
) -> None:
    path = tmp_path / "a.pt"
    torch.save({"w": torch.ones(4)}, path)
    _open(qtbot, window, path)
    error = LaunchError("rank 0: CorruptCheckpointError: __0_0.distcp is shorter than its records say")
    monkeypatch.setattr(load_panel, "run_load", _fake_load(error=error))
    panel = window.load_panel
    panel.load()
    qtbot.waitUntil(lambda: panel.status.text().startswith("2 ranks at 70 %"), timeout=10_000)
    _finish(qtbot, window, "load")
    assert panel.status.text() == "Failed: rank 0: __0_0.distcp is shorter than its records say"
    assert all(bar.property("failed") and "failed after loaded" in bar.format() for bar in panel.bars)
    assert panel.load_button.isEnabled()


def test_messages_are_kept_whole_in_the_log(qtbot: Any, window: MainWindow) -> None:
    long = "a message longer than any status bar " * 12 + "END"
    window.notifier.info("first")
    window.notifier.info(long)
    window.menu_actions["messages"].trigger()
    from dcpstudio.window.widgets.message_log import MessageLog

    log = window.findChild(MessageLog)
    assert log is not None and log.isVisible()
    window.notifier.error(ValueError("then this"))  # followed while open
    lines = log.text.toPlainText().splitlines()
    assert [line.split(None, 2)[2] for line in lines] == ["first", long, "then this"]
    log.text.selectAll()
    assert log.text.textCursor().selectedText().endswith("then this")


def test_compare_panes_number_from_zero_and_mark_the_first_difference(
    qtbot: Any, window: MainWindow, tmp_path: Path
) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(3, 4)}, a)
    changed = torch.zeros(3, 4)
    changed[1, 2] = 1.0
    torch.save({"w": changed}, b)
    _open(qtbot, window, a)
    view = window.compare_view
    view.run(b)
    _finish(qtbot, window, "compare")
    view.table.selectRow(0)
    qtbot.waitUntil(lambda: view.b_values.rowCount() == 3, timeout=20_000)
    for table in (view.a_values, view.b_values):
        assert table.verticalHeaderItem(0).text() == "0" and table.horizontalHeaderItem(0).text() == "0"
        marked = [(i, j) for i in range(3) for j in range(4) if table.item(i, j).data(BACKGROUND) is not None]
        assert marked == [(1, 2)]
    assert view.b_values.item(1, 2).text() == "1"


def test_histogram_count_axis_is_round_and_fits() -> None:
    from dcpstudio.window.widgets.drawing import Histogram, count_ticks

    assert count_ticks(1) == [0, 1] and count_ticks(2) == [0, 1, 2]
    assert count_ticks(1_374_862) == [0, 500_000, 1_000_000]
    h = Histogram()
    h.set_data([0.0, 1.0, 2.0], [1_374_862, 5])
    assert h.left_margin >= h.fontMetrics().horizontalAdvance("1,000,000") + 6


def test_kinds_read_the_same_in_every_format(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    pt, dcp, st = tmp_path / "x.pt", tmp_path / "x_dcp", tmp_path / "x.safetensors"
    torch.save({"w": torch.ones(2), "step": 7}, pt)
    torch_save_to_dcp(pt, dcp)
    save_file({"s": torch.tensor(1.5), "w": torch.ones(2)}, str(st))
    for path in (pt, dcp):
        _open(qtbot, window, path)
        model = window.tree_pane.model
        assert model is not None
        rows = {model.index(r, 0).data(): model.index(r, TYPE).data() for r in range(model.rowCount())}
        assert rows["step"] == "value"
    _open(qtbot, window, st)
    assert window.select("s")
    qtbot.waitUntil(lambda: window.details.preview_caption.text().startswith("Showing"), timeout=20_000)
    assert window.details.prop_labels["Kind"].text() == "tensor"  # a 0-d tensor is a tensor


def test_a_value_preview_is_captioned_in_the_kind_vocabulary(tmp_path: Path) -> None:
    """'Showing the value (int)' -- as Details' Kind says it -- not 'Showing a int' (issue 25, item 14)."""
    from dcpstudio.core import open_checkpoint
    from dcpstudio.window.widgets.details import preview_values

    torch.save({"step": 7, "w": torch.zeros(2)}, tmp_path / "m.pt")
    with open_checkpoint(tmp_path / "m.pt") as ckpt:
        assert preview_values(ckpt, "step") == (7, "the value (int)")
