"""Histograms (issue 25, item 14): Details and Values bin the same tensor alike; axes tick at round
values (1-2-5 x 10^k), a count axis at distinct whole numbers; no label leaves the widget."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from PySide6.QtCore import QRectF

from dcpstudio.window.axes import tick_text, value_ticks
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.widgets.drawing import Histogram
from tests.app.test_window import open_by_drop


def test_details_and_values_draw_the_same_bins(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)).half()
    torch.save({"x": x}, tmp_path / "x.pt")
    open_by_drop(qtbot, window, tmp_path / "x.pt")
    assert window.select("x")
    qtbot.waitUntil(lambda: bool(window.details.histogram.counts), timeout=20_000)
    details = (window.details.histogram.edges, window.details.histogram.counts)
    window.explore("x")
    qtbot.waitUntil(lambda: bool(window.explorer.histogram.counts), timeout=20_000)
    assert (window.explorer.histogram.edges, window.explorer.histogram.counts) == details


def test_value_ticks_are_round() -> None:
    ticks, step = value_ticks(-4.344, 2.234, 5)
    assert (ticks, step) == ([-4.0, -2.0, 0.0, 2.0], 2.0)
    assert [tick_text(t, step) for t in ticks] == ["-4", "-2", "0", "2"]
    ticks, step = value_ticks(0.0123, 0.0987, 4)
    assert [tick_text(t, step) for t in ticks] == ["0.02", "0.04", "0.06", "0.08"]
    assert value_ticks(1.5, 1.5) == ([1.5], 0.0)


def _inside(widget: Histogram, box: QRectF, text: str) -> bool:
    fits = widget.fontMetrics().horizontalAdvance(text) <= box.width() + 0.5
    return fits and QRectF(0, 0, widget.width(), widget.height()).contains(box)


def test_histogram_labels_are_round_distinct_and_inside(qtbot: Any) -> None:
    h = Histogram()
    qtbot.addWidget(h)
    h.resize(420, 160)
    edges = [-4.344 + 6.578 * i / 40 for i in range(41)]
    h.set_data(edges, [1_374_862] + [5] * 39)
    values = h.value_labels()
    assert [t for _, _, t in values] == ["-4", "-3", "-2", "-1", "0", "1", "2"] or [t for _, _, t in values] == [
        "-4", "-2", "0", "2",
    ]  # fmt: skip
    counts = h.count_labels()
    assert [t for _, _, t in counts] == ["0", "500,000", "1,000,000"]
    for widget_labels in (values, counts):
        assert all(_inside(h, box, text) for _, box, text in widget_labels)
    boxes = [box for _, box, _ in values]
    assert all(a.right() <= b.left() for a, b in itertools.pairwise(boxes))  # none overlap
    h.set_data([0.0, 0.5, 1.0], [1, 0])  # a small histogram: never "1 / 0 / 0"
    assert [t for _, _, t in h.count_labels()] == ["0", "1"]
    h.resize(150, 140)  # narrow: fewer value labels, still apart and inside
    h.set_data(edges, [3] * 40)
    boxes = [box for _, box, _ in h.value_labels()]
    assert boxes and all(a.right() <= b.left() for a, b in itertools.pairwise(boxes))
    assert all(_inside(h, box, text) for _, box, text in h.value_labels())
