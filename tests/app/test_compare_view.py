"""The compare view: B beside A in any format pair, every entry with its status and numbers,
sortable, filterable, cancellable, values side by side."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PySide6.QtCore import Qt

from dcpstudio.core import convert
from dcpstudio.window.compare_model import ROW_ROLE
from dcpstudio.window.main_window import MainWindow
from tests.app.test_window import finish, open_by_drop


def _rows(window: MainWindow) -> dict[str, Any]:
    view = window.compare_view
    return {r.fqn: r for r in view.model.rows}


def test_compare_lists_every_entry_with_status_and_numbers(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    a = {
        "same": torch.randn(30, 20, generator=g),
        "moved": torch.randn(50, generator=g),
        "gone": torch.ones(2),
        "step": 5,
    }
    b = {"same": a["same"].clone(), "moved": a["moved"] * 1.01, "new": torch.zeros(3), "step": 5}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    convert(tmp_path / "b.pt", tmp_path / "b_dcp", to="dcp")
    open_by_drop(qtbot, window, tmp_path / "a.pt")
    window.views.setCurrentWidget(window.compare_view)
    job = window.compare_view.run(tmp_path / "b_dcp")
    assert job is not None
    finish(qtbot, window, "compare")
    rows = _rows(window)
    assert {k: r.status for k, r in rows.items()} == {
        "same": "equal",
        "moved": "different",
        "gone": "only_a",
        "new": "only_b",
        "step": "equal",
    }
    moved = rows["moved"]
    x, y = a["moved"].double(), b["moved"].double()
    assert moved.rel_l2 == pytest.approx(float((x - y).norm() / x.norm()), rel=1e-6)
    assert moved.cosine == pytest.approx(1.0, abs=1e-9)
    assert moved.max_abs == pytest.approx(float((x - y).abs().max()), rel=1e-6)
    assert rows["same"].max_abs == 0 and rows["same"].cosine == pytest.approx(1.0)
    assert "5 entries" in window.compare_view.summary.text()
    view = window.compare_view
    view.table.sortByColumn(2, Qt.SortOrder.DescendingOrder)  # max abs diff, largest first
    assert view.proxy.index(0, 0).data(ROW_ROLE).fqn == "moved"
    view.differences.setChecked(True)
    assert {view.proxy.index(r, 0).data(ROW_ROLE).fqn for r in range(view.proxy.rowCount())} == {"moved", "gone", "new"}
    view.rtol.setText("0.02")  # tolerances are editable: within 2 %, "moved" is equal
    finish(qtbot, window, "compare") if view.run() is not None else None
    assert _rows(window)["moved"].status == "equal"
    view.differences.setChecked(False)
    row = next(r for r in range(view.proxy.rowCount()) if view.proxy.index(r, 0).data(ROW_ROLE).fqn == "same")
    view.table.selectRow(row)
    qtbot.waitUntil(lambda: view.b_values.rowCount() == 24 and view.a_values.rowCount() == 24, timeout=20_000)
    assert view.a_values.columnCount() == 12
    assert view.a_values.item(3, 4).text() == view.b_values.item(3, 4).text()
    assert view.a_caption.text().startswith("A: [:, :] rows 0–23")


def test_compare_is_cancellable(
    qtbot: Any, window: MainWindow, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save({f"t{i}": torch.randn(100) for i in range(50)}, tmp_path / "a.pt")
    open_by_drop(qtbot, window, tmp_path / "a.pt")
    started = threading.Event()
    import importlib

    diff_module = importlib.import_module("dcpstudio.core.ops.compare.diff")  # the package's `diff` is the function

    real = diff_module.compare

    def slow(a: Any, b: Any, **kw: Any) -> Any:
        on_entry = kw.pop("on_entry")

        def each(row: Any) -> None:
            started.set()
            time.sleep(0.05)
            on_entry(row)

        return real(a, b, on_entry=each, **kw)

    monkeypatch.setattr(diff_module, "compare", slow)
    window.compare_view.run(tmp_path / "a.pt")
    assert started.wait(20)
    window.menu_actions["cancel"].trigger()
    finish(qtbot, window, "compare")
    assert window.compare_view.summary.text().startswith("Cancelled after")
    assert window.compare_view.model.rowCount() < 50
