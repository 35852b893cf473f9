"""The Convert panel's model mapping on a generated llama-like torchtitan DCP (the helpers of
tests/core/test_mappings.py): choosing torchtitan-llama3 and a config previews the plan on a
worker; an entry no rule consumes is listed first, highlighted, and Convert is refused in the
panel; converting writes Hugging Face names, and Verify goes through the mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PySide6.QtCore import Qt
from safetensors.torch import load_file

from dcpstudio.window.main_window import MainWindow
from dcpstudio.window.plan_model import COLUMNS
from dcpstudio.window.widgets.mapping_choice import Preview
from tests.app.test_window import finish, open_by_drop
from tests.core.test_mappings import _reference_hf, _titan, _write

DST = COLUMNS.index("Destination")


def _choose(qtbot: Any, window: MainWindow, src: Path, cfg: Path) -> Preview:
    open_by_drop(qtbot, window, src)
    choice = window.panel.mapping
    choice.config.setText(str(cfg))
    with qtbot.waitSignal(choice.planned, timeout=20_000) as planned:
        choice.set_mapping("torchtitan-llama3")
    preview: Preview = planned.args[0]
    return preview


def _cell(model: Any, row: int, column: int, role: Qt.ItemDataRole = Qt.ItemDataRole.DisplayRole) -> Any:
    return model.data(model.index(row, column), role)


def test_preview_convert_and_verify_through_the_mapping(
    qtbot: Any, window: MainWindow, tmp_path: Path, qtmodeltester: Any
) -> None:
    sd = _titan()
    src, cfg = _write(tmp_path, sd)
    preview = _choose(qtbot, window, src, cfg)
    panel, dialog = window.panel, window.panel.mapping.dialog
    expected = _reference_hf(sd)
    assert preview.refusal is None and dialog.isVisible()
    assert dialog.summary.text().startswith("torchtitan-llama3: torchtitan → hf names, 21 entries")
    model = dialog.model
    qtmodeltester.check(model)
    rows = {_cell(model, r, DST): [_cell(model, r, c) for c in range(len(COLUMNS))] for r in range(model.rowCount())}
    assert set(rows) == set(expected)
    q = rows["model.layers.0.self_attn.q_proj.weight"]
    assert q[0] == "layers.0.attention.qkv_linear.wq.weight" and "permute" in q[1] and q[3] == "[32, 32]"
    assert _cell(model, 0, 0, Qt.ItemDataRole.BackgroundRole) is None
    assert not panel.include.isEnabled() and not panel.dtype.isEnabled()

    asked: list[Path | None] = []  # a mapped safetensors output is proposed as a Hugging Face folder
    window.save_path = lambda title, suggestion, filters: asked.append(suggestion)  # type: ignore[method-assign]
    assert panel.convert("safetensors") is None and asked[0] is not None
    assert asked[0].name == f"{src.name}_hf" and not asked[0].suffix
    panel.convert("safetensors", dst=tmp_path / "hf")
    finish(qtbot, window, "convert")
    assert panel.outcome.state == "ok", panel.report.toPlainText()
    assert "hf names via torchtitan-llama3" in panel.report.toPlainText()
    out: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        out |= load_file(shard)
    assert out.keys() == expected.keys() and all(torch.equal(out[k], v) for k, v in expected.items())
    assert (tmp_path / "hf" / "config.json").read_text() == cfg.read_text()

    panel.verify()
    finish(qtbot, window, "verify")
    lines = panel.report.toPlainText().splitlines()
    assert panel.last_diff is not None and panel.last_diff.equal, lines
    assert lines[:2] == [
        "equal: 21 entries compared",
        "A is the source through torchtitan-llama3 (hf names): 21 entries",
    ]
    panel.rtol.setText("1e-3")
    assert panel.verify() is None and "rtol/atol do not apply with a mapping" in panel.report.toPlainText()


def test_unmatched_entry_is_highlighted_and_convert_refused(qtbot: Any, window: MainWindow, tmp_path: Path) -> None:
    src, cfg = _write(tmp_path, {**_titan(), "extra.weight": torch.zeros(3)})
    preview = _choose(qtbot, window, src, cfg)
    panel, choice = window.panel, window.panel.mapping
    assert preview.refusal is not None and "extra.weight" in preview.refusal
    model = choice.dialog.model
    assert [_cell(model, 0, c) for c in range(3)] == ["extra.weight", "no rule", ""]
    assert _cell(model, 0, 0, Qt.ItemDataRole.BackgroundRole) is not None
    assert "matches no rule of torchtitan-llama3" in _cell(model, 0, 0, Qt.ItemDataRole.ToolTipRole)
    assert _cell(model, 1, 0, Qt.ItemDataRole.BackgroundRole) is None
    assert choice.dialog.summary.text().startswith("Refused: 1 entries match no rule of torchtitan-llama3")

    assert panel.convert("safetensors", dst=tmp_path / "hf") is None
    assert panel.report.toPlainText().startswith("Not started: 1 entries match no rule")
    assert panel.outcome.state == "error"
    assert not (tmp_path / "hf").exists()
    panel.split.setText("1GB")
    assert panel.convert("dcp", dst=tmp_path / "titan2") is None
    assert "with a mapping, only safetensors shards split" in panel.report.toPlainText()
    panel.split.clear()

    with qtbot.waitSignal(choice.planned, timeout=20_000) as planned:
        choice.allow.setChecked(True)
    assert planned.args[0].refusal is None and _cell(model, 0, 1) == "passed through"
    panel.convert("safetensors", dst=tmp_path / "hf")
    finish(qtbot, window, "convert")
    assert panel.outcome.state == "ok", panel.report.toPlainText()
    assert "extra.weight" in load_file(tmp_path / "hf" / "model.safetensors")
