"""Packed ``float4_e2m1fn_x2`` tensors (a byte of two 4-bit floats per torch element, no cast in
torch) in every pane: Details' preview, the Values table, copy as CSV, the slice summary and the
compare view's A/B panes show each element as its two values, ``lo | hi``, at torch's index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import CancelToken, torch_save_to_dcp
from dcpstudio.core.ops.explore.slices import SliceSpec
from dcpstudio.window.compare_model import ROW_ROLE
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.value_model import selection_csv
from tests.app.test_window import finish, open_by_drop

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_BYTES = [[0x21, 0x93, 0xF7, 0x0A], [0x45, 0x68, 0xBC, 0x1E], [0x70, 0x07, 0xD2, 0x3B]]


def _value(nibble: int) -> float:
    return -_E2M1[nibble & 7] if nibble & 8 else _E2M1[nibble]


def _pair(byte: int) -> tuple[float, float]:
    return _value(byte & 0x0F), _value(byte >> 4)


def _text(byte: int) -> str:
    return " | ".join(f"{v:.6g}" for v in _pair(byte))


def _save(path: Path, rows: list[list[int]]) -> None:
    packed = torch.tensor(rows, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    torch.save({"w": packed, "s": packed[0, 1].clone()}, path)  # "s": a 0-d element


def _wait_cell(qtbot: Any, window: MainWindow, r: int, c: int) -> tuple[str, str]:
    model = window.explorer.model
    assert model is not None
    model.index(r, c).data()
    qtbot.waitUntil(lambda: model.loaded(r, c), timeout=20_000)
    return str(model.index(r, c).data()), str(model.index(r, c).data(3))  # 3: ToolTipRole


@pytest.mark.parametrize("transposed", [False, True])
def test_float4_shows_both_values_of_each_element(
    qtbot: Any, window: MainWindow, tmp_path: Path, transposed: bool
) -> None:
    _save(tmp_path / "w.pt", _BYTES)
    open_by_drop(qtbot, window, tmp_path / "w.pt")
    values = [v for row in _BYTES for b in row for v in _pair(b)]
    text = [[_text(b) for b in row] for row in _BYTES]
    assert text[0][1] == "1.5 | -0.5"
    assert window.select("w")
    qtbot.waitUntil(lambda: "min" in window.details.stats_label.text(), timeout=20_000)
    preview = window.details.preview
    assert (preview.rowCount(), preview.columnCount()) == (3, 4)
    assert [[preview.item(r, c).text() for c in range(4)] for r in range(3)] == text
    assert "low nibble | high nibble" in window.details.preview_caption.text()
    assert window.select("s")
    qtbot.waitUntil(lambda: window.details.prop_labels["Value"].text() == text[0][1], timeout=20_000)
    assert window.details.preview.item(0, 0).text() == text[0][1]

    window.explore("w")
    ex = window.explorer
    if transposed:  # rows run down dim 1: the window is read as a transposed view of the bytes
        ex.set_spec(SliceSpec((3, 4), rows=1, cols=0, index=(0, 0)))
    assert ex.model is not None and ex.spec is not None
    at = (lambda r, c: (c, r)) if transposed else (lambda r, c: (r, c))
    cell, tip = _wait_cell(qtbot, window, *at(1, 2))
    assert cell == text[1][2] and "low nibble | high nibble" in tip
    assert _wait_cell(qtbot, window, *at(2, 3))[0] == text[2][3]
    csv = selection_csv(window.ckpt, "w", ex.spec, [(0, 1, 0, 2)], CancelToken())
    first = [_pair(b) for b in ([_BYTES[0][0], _BYTES[1][0]] if transposed else _BYTES[0][:2])]
    assert csv == ",".join(" | ".join(repr(v) for v in p) for p in first) + "\n"

    qtbot.waitUntil(lambda: ex.summary is not None, timeout=20_000)  # small slices are summarised at once
    s = ex.summary
    assert (s.count, s.finite, sum(s.hist_counts)) == (24, 24, 24)  # every decoded value counts
    assert (s.min, s.max) == (min(values), max(values))
    lo, hi = _pair(_BYTES[1][2])
    assert s.heat[at(1, 2)[0]][at(1, 2)[1]] == pytest.approx((lo + hi) / 2)


def test_float4_compare_panes_show_both_values(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    _save(tmp_path / "a.pt", _BYTES)
    _save(tmp_path / "b.pt", [[b ^ 0x10 for b in row] for row in _BYTES])
    torch_save_to_dcp(tmp_path / "b.pt", tmp_path / "b_dcp")  # B as a DCP
    open_by_drop(qtbot, window, tmp_path / "a.pt")
    view = window.compare_view
    window.views.setCurrentWidget(view)
    assert view.run(tmp_path / "b_dcp") is not None
    finish(qtbot, window, "compare")
    row = next(r for r in range(view.proxy.rowCount()) if view.proxy.index(r, 0).data(ROW_ROLE).fqn == "w")
    view.table.selectRow(row)
    qtbot.waitUntil(lambda: view.a_values.rowCount() == 3 and view.b_values.rowCount() == 3, timeout=20_000)
    assert view.a_values.item(1, 2).text() == _text(_BYTES[1][2])
    assert view.b_values.item(1, 2).text() == _text(_BYTES[1][2] ^ 0x10)
    assert "low nibble | high nibble" in view.a_caption.text()
