"""The window's Verify after a filtered, cast conversion compares through the same options (not
with the whole source); its outcome -- a result or an error -- is in the Convert panel, summary
first, the whole text under "Details…"; the convert buttons light up while a drag hovers them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PySide6.QtCore import QMimeData, QPoint, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDragLeaveEvent
from PySide6.QtWidgets import QApplication, QPlainTextEdit

from dcpstudio.core import ConversionResult
from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.widgets.drop_button import DropButton
from tests.app.test_window import finish


def test_verify_after_a_filtered_cast_conversion_uses_its_options(
    qtbot: Any, window: MainWindow, tmp_path: Path
) -> None:
    state = {f"model.layers.{i}.w": torch.randn(4, 3) for i in range(3)}
    state.update({f"optim.{i}": torch.randn(2) for i in range(5)})
    torch.save(state, tmp_path / "src.pt")
    panel = window.panel
    panel.include.setText(r"^model\.")
    panel.dtype.setCurrentText("bf16")
    panel.convert("safetensors", tmp_path / "src.pt", tmp_path / "out.safetensors")
    finish(qtbot, window, "convert")
    assert panel.last_result is not None and panel.outcome.state == "ok"
    panel.verify()
    finish(qtbot, window, "verify")
    lines = panel.report.toPlainText().splitlines()
    assert panel.last_diff is not None and panel.last_diff.equal, lines
    assert lines == [
        "equal: 3 entries compared",
        r"A is the source through --include '^model\.' --dtype bf16: 3 of 8 entries",
    ]
    assert panel.outcome.state == "ok"


def test_outcome_errors_in_the_panel_and_details(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    panel = window.panel
    torch.save({f"t{i}": torch.full((2,), float(i)) for i in range(60)}, tmp_path / "a.pt")
    torch.save({"t0": torch.zeros(2)}, tmp_path / "b.pt")
    panel.last_result = ConversionResult(tmp_path / "a.pt", tmp_path / "b.pt", "torch", 1, 0, 0)
    panel.rtol.setText("lots")
    assert panel.verify() is None
    assert panel.report.toPlainText().startswith("Not started: rtol must be") and panel.outcome.state == "error"
    panel.rtol.clear()
    panel.verify()
    finish(qtbot, window, "verify")
    text = panel.report.toPlainText()
    assert text.startswith("A and B differ; equal: 1, different: 0, only in A: 59") and panel.outcome.state == "differ"
    dialog = panel.outcome.show_details()
    view = dialog.findChild(QPlainTextEdit, "outcomeDetails")
    assert view is not None and view.toPlainText() == text and text.count("\n") == 59
    dialog.close()
    (tmp_path / "b.pt").unlink()
    panel.verify()
    finish(qtbot, window, "verify")
    assert panel.report.toPlainText().startswith("Verification failed: ") and panel.outcome.state == "error"
    split = panel.split
    split.setText("1GB")
    assert panel.convert("torch", tmp_path / "a.pt", tmp_path / "c.pt") is None
    assert "a torch.save checkpoint is one file" in panel.report.toPlainText() and panel.outcome.state == "error"


def _enter(button: DropButton, mime: QMimeData) -> None:
    event = QDragEnterEvent(
        QPoint(5, 5), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    QApplication.sendEvent(button, event)


def test_convert_buttons_highlight_while_a_drag_hovers(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    button = window.panel.buttons["dcp"]
    files = QMimeData()
    files.setUrls([QUrl.fromLocalFile(str(tmp_path / "x.pt"))])
    text = QMimeData()
    text.setText("not a file")
    assert button.property("dropHover") is False
    _enter(button, text)
    assert button.property("dropHover") is False  # nothing it would take
    _enter(button, files)
    assert button.property("dropHover") is True
    assert window.panel.buttons["torch"].property("dropHover") is False
    leave = QDragLeaveEvent()
    QApplication.sendEvent(button, leave)
    assert button.property("dropHover") is False
