"""The Run view (issue 31): a folder of DCP checkpoints by step opens as a run -- the step list, the
tree shaded by the step's relative change, the plot of the entry selected (its points are the
report's), hover values, the anomaly list, and a click on a point at step k comparing steps k-1
and k on that entry only (a tensor, or a module's entries), which Compare Everything widens; a
Hugging Face Trainer run's trainer_state.json scalars in the values table. The run is made here with
``dcp.save`` on one process: four steps of three layers, layer 1 frozen from the third step on."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtTest import QTest

from dcpstudio.window.main_window import MainWindow
from tests.app.test_window import finish


def hover_until(qtbot: Any, viewport: Any, aim: Callable[[], QPoint], shown: Callable[[], bool]) -> QPoint:
    """Move the mouse onto ``aim()`` until ``shown()`` holds with the point where it was on the try before:
    a plot takes its range when it is next laid out, so a point computed before that moves with it (and
    Qt drops a move onto the cursor's own position, hence the one-pixel step between tries). Returns the
    point, settled, for a click."""
    last: list[QPoint] = []

    def settled() -> bool:
        point = aim()
        at = QPoint(point.x() + len(last) % 2, point.y())
        assert viewport.rect().contains(at), at
        QTest.mouseMove(viewport, at)
        qtbot.wait(20)
        same = bool(last) and last[-1] == point
        last.append(point)
        return same and shown() and aim() == point

    qtbot.waitUntil(settled, timeout=10_000)
    return last[-1]


STEPS = (10, 20, 30, 40)
FROZEN = "model.layers.1.w"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("runs") / "run"
    g = torch.Generator().manual_seed(3)
    weights = {f"model.layers.{i}.w": torch.randn(12, 8, generator=g) for i in range(3)}
    for step in STEPS:
        for name, w in weights.items():
            if not (name == FROZEN and step >= 30):
                w.add_(0.01 * torch.randn(w.shape, generator=g))
        model = {name.split(".", 1)[1]: w.clone() for name, w in weights.items()}
        dcp.save({"model": model, "step": step}, checkpoint_id=str(root / f"step-{step}"))
    return root


def _open_run(qtbot: Any, window: MainWindow, root: Path | None) -> Any:
    """Open ``root`` (None: being opened already) and wait for its report."""
    if root is not None:
        window.open_path(root)
    qtbot.waitUntil(lambda: window.runs.view is not None and "drift" in window.jobs, timeout=20_000)
    finish(qtbot, window, "drift")
    assert window.runs.report is not None, window.runs.view.status.text()
    return window.runs.view


def test_a_run_folder_opens_as_a_run(qtbot: Any, window: MainWindow, tiny_run: Path) -> None:
    minimum = window.minimumSizeHint()
    view = _open_run(qtbot, window, tiny_run)
    assert window.minimumSizeHint().width() == minimum.width()  # the Run view fits where the other views do
    # the Convert/Load area folds while the Run view is shown (it wants the height), the user's
    # choice unchanged, and unfolds for another view
    assert not window.actions_tabs.isVisibleTo(window) and window.settings.actions_shown()
    window.views.setCurrentWidget(window.details)
    assert window.actions_tabs.isVisibleTo(window)
    window.views.setCurrentWidget(view)
    assert not window.actions_tabs.isVisibleTo(window)
    window.right.toggle.setChecked(True)  # unfolded by hand: stays for every view
    window.views.setCurrentWidget(window.details)
    window.views.setCurrentWidget(view)
    assert window.actions_tabs.isVisibleTo(window)
    window.right.toggle.setChecked(False)  # folded by hand: remembered, and stays folded
    window.views.setCurrentWidget(window.details)
    assert not window.actions_tabs.isVisibleTo(window) and not window.settings.actions_shown()
    window.right.toggle.setChecked(True)
    window.views.setCurrentWidget(view)
    report = window.runs.report
    assert window.views.currentWidget() is view
    assert window.ckpt is not None and window.ckpt.path == tiny_run / "step-40"  # the latest step in the tree
    assert [view.steps.item(r, 0).text() for r in range(view.steps.rowCount())] == [str(s) for s in STEPS]
    assert view.steps.item(3, 1).text() == "step-40"
    assert window.settings.recent()[0] == str(tiny_run)  # File › Open Recent reopens the run, not a step

    # the anomaly list names the frozen layer at its first unchanged step
    rows = [tuple(view.anomalies.item(r, c).text() for c in range(4)) for r in range(view.anomalies.rowCount())]
    assert ("30", FROZEN, "frozen") in [r[:3] for r in rows], rows
    assert view.steps.item(2, 2).text() != ""  # the step's anomaly count

    # the tree is shaded by the latest step's change: the frozen layer blue-grey, the others not
    from dcpstudio.window.heat import FROZEN as GREY

    model = window.tree_pane.model
    shade = {n: model.index_of(n).data(Qt.ItemDataRole.BackgroundRole) for n in (FROZEN, "model.layers.0.w")}
    assert shade[FROZEN] == GREY and shade["model.layers.0.w"] not in (None, GREY)
    assert "relative change at step 40" in model.index_of(FROZEN).data(Qt.ItemDataRole.ToolTipRole)
    assert "step 40" in view.legend.text()

    # selecting a tensor plots its series: the points drawn are the report's finite values
    name = "model.layers.0.w"
    assert window.select(name)
    assert view.plot.widget.getPlotItem().titleLabel.text == name
    want = report.series[name]["rel_change"]
    xs, ys = view.plot.plotted()
    assert xs == [float(s) for s, v in zip(STEPS, want, strict=True) if v is not None] and len(xs) == 3
    assert ys == [v for v in want if v is not None]
    view.metric_box.setCurrentIndex(view.metric_box.findData("norm"))
    assert view.plot.plotted()[1] == pytest.approx(report.series[name]["norm"])
    view.metric_box.setCurrentIndex(view.metric_box.findData("rel_change"))
    assert window.select("model.layers")  # a group: its module's series
    assert view.plot.plotted()[1] == [v for v in report.groups["model.layers"]["rel_change"] if v is not None]
    assert window.select(name)

    # hover: the nearest step's value; a click on the point at step 30 compares steps 20 and 30
    def aim_step_30() -> QPoint:
        point = view.plot.scene_point(2)
        assert point is not None
        return point.toPoint()

    at = hover_until(qtbot, view.plot.widget.viewport(), aim_step_30, lambda: "step 30" in view.plot.hover_text())
    assert f"{want[2]:.4g}" in view.plot.hover_text()
    QTest.mouseClick(view.plot.widget.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, at)
    compare = window.compare_view
    qtbot.waitUntil(lambda: window.views.currentWidget() is compare, timeout=20_000)
    finish(qtbot, window, "compare")
    assert window.ckpt.path == tiny_run / "step-20" and compare.b_path.text() == str(tiny_run / "step-30")
    qtbot.waitUntil(lambda: compare.selected_fqn() == name, timeout=5_000)
    # on that tensor only: one row, selected, its values side by side; Compare Everything widens
    assert [r.fqn for r in compare.model.rows] == [name] and compare.focus == name
    assert compare.focus_bar.isVisibleTo(compare) and name in compare.focus_label.text()
    row = compare.table.currentIndex().siblingAtColumn(0).data(Qt.ItemDataRole.UserRole + 1)
    assert math.isclose(row.rel_l2, want[2], rel_tol=1e-6)
    qtbot.waitUntil(lambda: compare.a_values.rowCount() == 12 and compare.b_values.rowCount() == 12, timeout=5_000)
    assert view.status.text().startswith("Compared step 20 with step 30 on model.layers.0.w: see Compare")
    compare.widen_button.click()
    finish(qtbot, window, "compare")
    assert {r.fqn for r in compare.model.rows} == {"model.layers.0.w", FROZEN, "model.layers.2.w", "step"}
    assert compare.focus is None and not compare.focus_bar.isVisibleTo(compare)
    assert view.position == 1  # the tree shows step 20, shaded by its change
    assert "step 20" in window.tree_pane.model.index_of(name).data(Qt.ItemDataRole.ToolTipRole)
    assert str(tiny_run / "step-20") not in window.settings.recent()  # a step shown, not a file opened

    # a group's point at step 40: the module's entries compared, steps 30 and 40
    window.views.setCurrentWidget(view)
    assert window.select("model.layers")
    view._point_clicked(3)
    qtbot.waitUntil(lambda: compare.focus == "model.layers", timeout=20_000)
    finish(qtbot, window, "compare")
    assert [r.fqn for r in compare.model.rows] == ["model.layers.0.w", FROZEN, "model.layers.2.w"]
    assert compare.focus == "model.layers" and compare.selected_fqn() == "model.layers.0.w"
    assert window.ckpt.path == tiny_run / "step-30" and compare.b_path.text() == str(tiny_run / "step-40")
    assert {r.fqn: r.status for r in compare.model.rows}[FROZEN] == "equal"

    # activating an anomaly shows its step, its entry selected and plotted
    row = next(r for r in range(view.anomalies.rowCount()) if view.anomalies.item(r, 2).text() == "frozen")
    view.anomalies.cellDoubleClicked.emit(row, 1)
    qtbot.waitUntil(lambda: window.ckpt.path == tiny_run / "step-30", timeout=20_000)
    qtbot.waitUntil(lambda: getattr(window.selected_node(), "path", None) == FROZEN, timeout=5_000)
    assert view.plot.widget.getPlotItem().titleLabel.text == FROZEN and view.position == 2
    assert view.plot.rings.xData.tolist() == [30.0] and view.plot.marker.value() == 30  # its anomaly, the step

    # the heat map: a row per tensor, a column per step, the frozen layer blue-grey from step 30;
    # a click on a cell shows that step with that tensor
    heat = view.heat
    assert heat.names == list(report.series) and heat.changes.shape == (len(report.series), len(STEPS))
    frozen_row = heat.names.index(FROZEN)
    assert heat.changes[frozen_row, 2:].tolist() == [0.0, 0.0] and math.isnan(heat.changes[frozen_row, 0])
    from dcpstudio.window.widgets.run_heat import _on_white

    assert heat.image.image[frozen_row, 3].tolist() == _on_white(GREY.getRgb())[0].tolist()
    window.views.setCurrentWidget(view)  # the Compare view was shown since
    view.lists.setCurrentWidget(heat)
    row0 = heat.names.index(name)
    cell = hover_until(
        qtbot,
        heat.widget.viewport(),
        lambda: heat.cell_point(row0, 3).toPoint(),
        lambda: heat.hover_text().startswith(name),
    )
    assert f"step 40: relative change {want[3]:.4g}" in heat.hover_text()
    QTest.mouseClick(heat.widget.viewport(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, cell)
    qtbot.waitUntil(lambda: window.ckpt.path == tiny_run / "step-40", timeout=20_000)
    qtbot.waitUntil(lambda: getattr(window.selected_node(), "path", None) == name, timeout=5_000)


def test_open_as_run_refuses_a_checkpoint_takes_a_pattern_and_the_window_starts_without_pyqtgraph(
    qtbot: Any, window: MainWindow, tiny_run: Path, tmp_path: Path
) -> None:
    fresh = "pyqtgraph" not in sys.modules  # (another test may have imported it in this process)
    window.runs.ask_run = lambda: (str(tiny_run / "step-10"), None)  # type: ignore[method-assign]
    window.menu_actions["open_run"].trigger()
    finish(qtbot, window, "open")
    assert "is not a run" in window.message_bar.text(), window.message_bar.text()
    assert window.runs.view is None and window.ckpt is None and window.views.count() == 3
    if fresh:
        assert "pyqtgraph" not in sys.modules

    odd = tmp_path / "odd"  # checkpoints named in no usual way: w10, w20, ...
    odd.mkdir()
    for step in STEPS:
        (odd / f"w{step}").symlink_to(tiny_run / f"step-{step}", target_is_directory=True)
    window.runs.ask_run = lambda: (str(odd), None)  # type: ignore[method-assign]
    window.menu_actions["open_run"].trigger()
    finish(qtbot, window, "open")
    assert "is not a run" in window.message_bar.text() and window.runs.view is None
    window.runs.ask_run = lambda: (str(odd), r"w(?P<step>\d+)")  # type: ignore[method-assign]
    window.menu_actions["open_run"].trigger()
    view = _open_run(qtbot, window, None)
    assert [view.steps.item(r, 1).text() for r in range(view.steps.rowCount())] == [f"w{s}" for s in STEPS]
    assert window.runs.run.convention == "pattern" and window.ckpt.path == odd / "w40"


def test_the_open_as_run_dialog_checks_its_pattern(qtbot: Any) -> None:
    from dcpstudio.window.widgets.open_run import OpenRunDialog, pattern_problem

    assert pattern_problem("") == "" and pattern_problem(r"ckpt_(\d+)") == ""
    assert "group" in pattern_problem("ckpt_") and "regular expression" in pattern_problem("ckpt_(")
    dialog = OpenRunDialog("/runs/a")
    qtbot.addWidget(dialog)
    ok = dialog.buttons.button(dialog.buttons.StandardButton.Ok)
    assert ok.isEnabled() and dialog.choice() == ("/runs/a", None)
    dialog.pattern.setText("ckpt_")
    assert not ok.isEnabled() and "group" in dialog.problem.text()
    dialog.pattern.setText(r"ckpt_(?P<step>\d+)")
    assert ok.isEnabled() and dialog.choice() == ("/runs/a", r"ckpt_(?P<step>\d+)")


def test_a_shaded_tree_model_passes_qtmodeltester(qtmodeltester: Any, tiny_run: Path) -> None:
    from dcpstudio.core import open_checkpoint
    from dcpstudio.window.tree_model import CheckpointTreeModel

    with open_checkpoint(tiny_run / "step-40") as ckpt:
        model = CheckpointTreeModel(ckpt.tree)
        scale = model.shade({"model.layers.0.w": 1e-3, FROZEN: 0.0, "model.layers.2.w": math.inf}, "change")
        qtmodeltester.check(model)
        assert scale is not None and (scale.lo, scale.hi) == (1e-3, 1e-3)
        group = model.index_of("model.layers")
        assert model.shades[id(model.node(group))] == math.inf  # a group: the largest change below


def test_a_damaged_step_is_said_in_the_run_view_and_cancel_stops_the_analysis(
    qtbot: Any, window: MainWindow, tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    import time

    import dcpstudio.core.ops.drift as drift_ops

    damaged = tmp_path / "run"
    shutil.copytree(tiny_run, damaged)
    data = next((damaged / "step-20").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:64])
    window.open_path(damaged)
    qtbot.waitUntil(lambda: window.runs.view is not None and "drift" in window.jobs, timeout=20_000)
    finish(qtbot, window, "drift")
    view = window.runs.view
    assert window.runs.report is None
    assert view.status.text().startswith("Not analysed: ") and "past the end" in view.status.text()
    assert view.status.property("state") == "error" and view.again_button.isEnabled()
    # a comparison on the damaged step ends in its error, said in the Compare view and in the Run view
    window.runs.compare(1, 2, "model.layers.0.w")
    qtbot.waitUntil(lambda: window.compare_view.focus == "model.layers.0.w", timeout=20_000)
    finish(qtbot, window, "compare")
    assert window.compare_view.summary.text().startswith("Not compared: ")
    assert view.status.text().startswith("Not compared (step 20 with step 30 on model.layers.0.w): ")
    assert view.status.property("state") == "error"

    real = drift_ops.drift

    def held(run: Any, *, progress: Any = None, cancel: Any = None) -> Any:
        def report(p: Any) -> None:  # the first progress report waits for Cancel
            progress(p)
            while not cancel.cancelled:
                time.sleep(0.01)

        return real(run, progress=report, cancel=cancel)

    monkeypatch.setattr(drift_ops, "drift", held)
    window.open_path(tiny_run)
    qtbot.waitUntil(lambda: window.runs.run is not None and window.runs.run.location == tiny_run, timeout=20_000)
    qtbot.waitUntil(lambda: view.cancel_button.isVisible(), timeout=5_000)
    view.cancel_button.click()
    finish(qtbot, window, "drift")
    assert window.runs.report is None and view.status.text() == "Cancelled: nothing was computed."
    assert not view.cancel_button.isVisible() and view.again_button.isEnabled()


def test_a_trainer_run_shows_its_trainer_state_by_step(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    """Hugging Face Trainer ``checkpoint-N`` folders: trainer_state.json's step, epoch, learning rate
    and loss in Values by Step, a column per step; a malformed one is a note in the Run view."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 4, generator=g)
    history: list[dict[str, Any]] = []
    for step in (10, 20, 30):
        w.add_(0.01 * torch.randn(w.shape, generator=g))
        folder = tmp_path / "run" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"model.w": w.clone()}, str(folder / "model.safetensors"))
        history.append({"step": step, "loss": 3.0 - step / 10, "learning_rate": 1e-3 / step})
        state = {"global_step": step, "epoch": step / 20, "log_history": history}
        (folder / "trainer_state.json").write_text(json.dumps(state) if step < 30 else '{"global_step": ')
    view = _open_run(qtbot, window, tmp_path / "run")
    table = view.values
    rows = {table.item(r, 0).text(): [table.item(r, c).text() for c in range(1, 4)] for r in range(table.rowCount())}
    assert [table.horizontalHeaderItem(c).text() for c in range(4)] == ["Value", "step 10", "step 20", "step 30"]
    assert rows["trainer_state.global_step"] == ["10", "20", ""]
    assert rows["trainer_state.epoch"] == ["0.5", "1.0", ""]
    assert rows["trainer_state.loss"] == ["2.0", "1.0", ""]
    assert rows["trainer_state.learning_rate"] == ["0.0001", "5e-05", ""]
    assert view.lists.tabText(2) == "Values by Step (4)"
    assert "Note: checkpoint-30/trainer_state.json: not JSON" in view.status.text(), view.status.text()
