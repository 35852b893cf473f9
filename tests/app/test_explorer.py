"""The value explorer: any 2-D slice of an N-D tensor, paged lazily (only the bytes on screen are
read), index spin boxes, copy as CSV, heatmap and histogram, export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PySide6.QtCore import QItemSelection, QItemSelectionModel
from PySide6.QtGui import QGuiApplication

from dcpstudio.core import torch_save_to_dcp
from dcpstudio.core.checkpoints.base import Checkpoint
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.value_model import format_value
from tests.app.test_window import finish, open_by_drop


def _cell(window: MainWindow, r: int, c: int) -> str:
    model = window.explorer.model
    assert model is not None
    return str(model.index(r, c).data())


def _wait_cell(qtbot: Any, window: MainWindow, r: int, c: int) -> str:
    model = window.explorer.model
    assert model is not None
    model.index(r, c).data()  # asks for its tile
    qtbot.waitUntil(lambda: model.loaded(r, c), timeout=20_000)
    return _cell(window, r, c)


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_explorer_slices_an_nd_tensor(qtbot: Any, window: MainWindow, tmp_path: Path, fmt: str) -> None:
    x = torch.arange(20 * 3 * 4 * 5, dtype=torch.float32).reshape(20, 3, 4, 5) / 7
    torch.save({"x": x}, tmp_path / "x.pt")
    path = tmp_path / "x.pt"
    if fmt == "dcp":
        torch_save_to_dcp(path, tmp_path / "x_dcp")
        path = tmp_path / "x_dcp"
    open_by_drop(qtbot, window, path)
    window.explore("x")
    ex = window.explorer
    assert window.views.currentWidget() is ex and ex.model is not None
    assert (ex.model.rowCount(), ex.model.columnCount()) == (20, 3)
    assert sorted(ex.index_boxes) == [2, 3] and ex.slice_label.text() == "showing [:, :, 0, 0]"
    assert _wait_cell(qtbot, window, 7, 2) == format_value(float(x[7, 2, 0, 0]))
    ex.index_boxes[2].setValue(3)
    ex.index_boxes[3].setValue(4)
    assert ex.slice_label.text() == "showing [:, :, 3, 4]"
    assert _wait_cell(qtbot, window, 19, 1) == format_value(float(x[19, 1, 3, 4]))
    ex.rows_box.setCurrentIndex(3)  # rows: dim 3, columns still dim 1
    ex.rows_box.activated.emit(3)
    assert ex.spec is not None and (ex.spec.rows, ex.spec.cols) == (3, 1)
    assert ex.slice_label.text() == "showing [0, :, 3, :]"
    assert (ex.model.rowCount(), ex.model.columnCount()) == (5, 3)
    assert _wait_cell(qtbot, window, 4, 2) == format_value(float(x[0, 2, 3, 4]))
    ex.cols_box.setCurrentIndex(3)  # picking the rows' dimension for columns swaps them
    ex.cols_box.activated.emit(3)
    assert (ex.spec.rows, ex.spec.cols) == (1, 3)
    qtbot.waitUntil(lambda: ex.summary is not None, timeout=20_000)  # small slices are summarised at once
    assert ex.summary.count == 15 and ex.summary.max == pytest.approx(float(x[0, :, 3, :].max()))
    assert sum(ex.summary.hist_counts) == 15


def test_explorer_reads_only_what_is_on_screen(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = torch.randn(6000, 1024)  # 24 MiB: more than the explorer summarises unasked
    torch.save({"big": big}, tmp_path / "big.pt")
    open_by_drop(qtbot, window, tmp_path / "big.pt")
    read: list[int] = []
    real = type(window.ckpt).read_tensor

    def counting(self: Checkpoint, fqn: str, region: Any = None) -> torch.Tensor:
        out = real(self, fqn, region)
        read.append(out.numel())
        return out

    monkeypatch.setattr(type(window.ckpt), "read_tensor", counting)
    window.resize(1400, 860)
    window.explore("big")
    ex = window.explorer
    assert _wait_cell(qtbot, window, 0, 0) == format_value(float(big[0, 0]))
    ex.go_to(5000, 1000)
    assert _wait_cell(qtbot, window, 5000, 1000) == format_value(float(big[5000, 1000]))
    qtbot.wait(300)
    assert ex.summary is None  # not summarised: it was not asked for
    assert 0 < sum(read) < 200_000, sum(read)  # of 6,144,000 values


def test_copy_selection_as_csv_and_export(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(40, 30, dtype=torch.float64)
    torch.save({"x": x, "b": torch.randn(8, 4).bfloat16()}, tmp_path / "x.pt")
    open_by_drop(qtbot, window, tmp_path / "x.pt")
    window.explore("x")
    ex = window.explorer
    assert ex.model is not None
    selection = QItemSelection(ex.model.index(2, 3), ex.model.index(4, 5))
    ex.table.selectionModel().select(selection, QItemSelectionModel.SelectionFlag.ClearAndSelect)
    ex.copy_selection()
    finish(qtbot, window, "explore-copy")
    rows = [line.split(",") for line in QGuiApplication.clipboard().text().splitlines()]
    assert np.array(rows, dtype=np.float64).tolist() == x[2:5, 3:6].tolist()  # full precision
    ex.table.selectAll()
    monkeypatch.setattr("dcpstudio.window.widgets.value_explorer.COPY_LIMIT", 100)
    assert ex.copy_selection() is None and "at most 100" in window.message_bar.text()
    dst = tmp_path / "x_out.npy"
    window.save_path = lambda title, suggestion, filters: dst  # type: ignore[method-assign]
    window.explore("b")
    ex.export()
    finish(qtbot, window, "explore-export")
    assert "float32" in window.message_bar.text()  # the note: NumPy has no bfloat16
    assert np.load(dst).tolist() == torch.load(tmp_path / "x.pt")["b"].float().tolist()
    pt = tmp_path / "b.pt"
    window.save_path = lambda title, suggestion, filters: pt  # type: ignore[method-assign]
    ex.export()
    finish(qtbot, window, "explore-export")
    back = torch.load(pt, weights_only=True)
    assert back.dtype == torch.bfloat16 and torch.equal(back, torch.load(tmp_path / "x.pt")["b"])
