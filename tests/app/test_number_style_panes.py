"""The tree's Params column and Details' Elements read a tensor's size in the one number style:
"3.2 K" in both, never "3,200" in one pane and "65.5 K" in the other (issue 25, item 14)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.tree_model import PARAMS
from tests.app.test_window import open_by_drop


def test_tree_and_details_show_a_size_alike(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    torch.save({"small": torch.zeros(3200), "big": torch.zeros(65_536)}, tmp_path / "m.pt")
    open_by_drop(qtbot, window, tmp_path / "m.pt")
    model = window.tree_pane.model
    assert model is not None
    params = {model.index(r, 0).data(): model.index(r, PARAMS).data() for r in range(model.rowCount())}
    assert params == {"small": "3.2 K", "big": "65.5 K"}
    assert window.select("small")
    assert window.details.prop_labels["Elements"].text() == "3.2 K (3,200)"
