"""Convert › Check in the window: the findings of core's check in a table (file, entry, what),
summary first, the damaged entry and its group marked in the tree; a whole checkpoint says
"whole" and another checkpoint's tree starts unmarked."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from PySide6.QtCore import Qt

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.window.main_window import MainWindow
from tests.app.test_window import finish, open_by_drop


@pytest.fixture(scope="module")
def whole_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkwin")
    g = torch.Generator().manual_seed(5)
    torch.save({"model.a": torch.randn(40, 30, generator=g), "model.b": torch.randn(50, 20, generator=g), "step": 7},
               root / "m.pt")  # fmt: skip
    convert(root / "m.pt", root / "m.dcp", to="dcp", files=2)
    return root / "m.dcp"


def _truncated(whole: Path, tmp_path: Path) -> tuple[Path, str]:
    dcp = tmp_path / "cut.dcp"
    shutil.copytree(whole, dcp)
    with open_checkpoint(dcp) as ckpt:
        (c,) = ckpt.resolve_chunks("model.b")
    assert c.file is not None and c.offset is not None and c.length is not None
    with open(dcp / c.file, "r+b") as f:
        f.truncate(c.offset + c.length // 2)
    return dcp, c.file


def _check(qtbot: Any, window: MainWindow) -> Any:
    window.menu_actions["check"].trigger()
    finish(qtbot, window, "check")
    return window.check_view  # type: ignore[attr-defined]


def _marked(window: MainWindow, path: str) -> bool:
    model = window.tree_pane.model
    assert model is not None
    index = model.index_of(path)
    assert index.isValid()
    return index.data(Qt.ItemDataRole.DecorationRole) is not None


def test_check_lists_a_truncated_distcp_and_marks_the_tree(
    qtbot: Any, window: MainWindow, whole_dcp: Path, tmp_path: Path
) -> None:
    dcp, file = _truncated(whole_dcp, tmp_path)
    open_by_drop(qtbot, window, dcp)
    view = _check(qtbot, window)
    assert view.summary.text().startswith("damaged: "), view.summary.text()
    rows = [tuple(view.table.item(r, c).text() for c in range(3)) for r in range(view.table.rowCount())]
    assert any(f == file and e == "model.b" and "past the end" in what for f, e, what in rows), rows
    assert _marked(window, "model.b") and _marked(window, "model")  # the entry and its group
    assert not _marked(window, "model.a") and not _marked(window, "step")
    index = window.tree_pane.model.index_of("model.b")  # type: ignore[union-attr]
    assert "past the end" in index.data(Qt.ItemDataRole.ToolTipRole)

    open_by_drop(qtbot, window, whole_dcp)  # another checkpoint: unmarked, and whole
    assert not _marked(window, "model.b")
    view = _check(qtbot, window)
    assert view.summary.text().startswith("whole: ") and view.table.rowCount() == 0
    assert not _marked(window, "model.b") and not _marked(window, "model")


def test_a_marked_tree_model_passes_qtmodeltester(qtmodeltester: Any, whole_dcp: Path) -> None:
    from dcpstudio.window.tree_model import CheckpointTreeModel

    with open_checkpoint(whole_dcp) as ckpt:
        model = CheckpointTreeModel(ckpt.tree)
        model.mark({"model.b": "cut short", "not.in.tree": "ignored"})
        assert len(model.marks) == 2  # model.b and model
        qtmodeltester.check(model)
