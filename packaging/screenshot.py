"""Take the README's screenshots of the window, each on checkpoints generated here:

- ``screenshot.png``: a DCP checkpoint saved by 3 gloo ranks, a tensor's chunks, files and byte ranges;
- ``explorer.png``: the value explorer on the demo's bf16 embedding, paged to row 40, column 20,
  with its heatmap and histogram;
- ``compare.png``: the demo checkpoint against a fine-tuned copy in safetensors, sorted by
  relative L2 change;
- ``run.png``: the Run view of a tiny model trained for 12 steps on the CPU (a torchtitan-style
  ``step-N`` DCP folder per step), one layer frozen from step 8 and one bit flipped in what step 6
  saved: the tree shaded by step 6's change, the flipped tensor's plot, the anomalies.

xvfb-run -s "-screen 0 1600x1000x24" python packaging/screenshot.py resources/ [run ...]
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZE = (1560, 940)
SHOTS = ("screenshot", "explorer", "compare", "run")  # all, or those named after the folder


def _wait(app: Any, done: Callable[[], bool]) -> None:
    while not done():
        app.processEvents()
    for _ in range(30):
        app.processEvents()


def _window(app: Any, folder: Path, ckpt: Path) -> Any:
    from dcpstudio.window.main_window import MainWindow

    window = MainWindow()
    window.browser.set_root(str(folder))
    window.resize(*SIZE)
    window.right.toggle.setChecked(False)  # the Convert/Load area folded: the view shown gets its height
    window.show()
    window.open_path(ckpt)
    _wait(app, lambda: window.ckpt is not None)
    return window


def chunks(app: Any, tmp: Path, out: Path) -> None:
    from tests import _ranks

    ckpt = tmp / "llama_3ranks_dcp"
    _ranks.save_sharded_model(ckpt, world=3)
    window = _window(app, tmp, ckpt)
    window.tree.expandToDepth(2)
    window.select("model.layers.0.feed_forward.w1.weight")
    _wait(app, lambda: "min" in window.details.stats_label.text())
    window.grab().save(str(out))
    window.close()


def explorer(app: Any, demo: Path, out: Path) -> None:
    window = _window(app, demo.parent, demo)
    name = "model.tok_embeddings.weight"
    window.select(name)
    window.explore(name)
    values = window.explorer
    _wait(app, lambda: values.model is not None and values.model.loaded(0, 0))
    values.go_to(40, 20)
    _wait(app, lambda: values.model.loaded(40, 20) and values.summary is not None)
    window.grab().save(str(out))
    window.close()


def _fine_tuned(demo_pt: Path, dst: Path) -> None:
    """The demo's tensors, 9 of them nudged by ~2 % (three layers' wq, wv and w2) and its
    optimizer state left out, as a fine-tune exported to safetensors would be."""
    import torch
    from safetensors.torch import save_file

    def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(obj, dict):
            return {prefix[:-1]: obj}
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    g = torch.Generator().manual_seed(0)
    state = {k: v for k, v in flat(torch.load(demo_pt, weights_only=True)).items() if isinstance(v, torch.Tensor)}
    tuned = {}
    for k, v in state.items():
        if k.startswith("optim."):
            continue
        if any(f"layers.{i}." in k for i in (2, 5, 9)) and k.endswith(("wq.weight", "wv.weight", "w2.weight")):
            v = (v.float() + 0.02 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
        tuned[k] = v.clone()  # tied weights (the embedding and the output) share storage: each its own copy
    save_file(tuned, dst)


def compare(app: Any, demo: Path, demo_pt: Path, tmp: Path, out: Path) -> None:
    from PySide6.QtCore import Qt

    tuned = tmp / "tuned.safetensors"
    _fine_tuned(demo_pt, tuned)
    window = _window(app, demo.parent, demo)
    window.select("model.tok_embeddings.weight")
    window.views.setCurrentWidget(window.compare_view)
    view = window.compare_view
    view.run(tuned)
    _wait(app, lambda: "entries:" in view.summary.text())
    view.table.sortByColumn(3, Qt.SortOrder.DescendingOrder)
    view.table.selectRow(0)
    _wait(app, lambda: view.a_values.rowCount() > 0 and view.b_values.rowCount() > 0)
    window.grab().save(str(out))
    window.close()


def run_view(app: Any, tmp: Path, out: Path) -> None:
    from tests import _runs

    trained = _runs.train(12, freeze=("layers.2.", 8))
    name = "model.layers.0.attention.wq.weight"
    root = _runs.save_titan_run(tmp / "titan_run", trained, flip=_runs.Flip(6, name, 100))
    window = _window(app, tmp, root)
    _wait(app, lambda: window.runs.report is not None)
    view = window.runs.view
    view.steps.selectRow(5)  # step 6: the tree shows it, shaded by its change
    _wait(app, lambda: window.ckpt is not None and window.ckpt.path.name == "step-6")
    window.tree.expandToDepth(2)
    window.select(name)
    window.views.setCurrentWidget(view)
    view.metric_box.setCurrentIndex(view.metric_box.findData("max_abs_change"))  # where the flipped bit shows
    _wait(app, lambda: view.plot.plotted()[0] != [])
    from PySide6.QtTest import QTest

    point = view.plot.scene_point(5)
    if point is not None:  # the hover label of step 6's point
        QTest.mouseMove(view.plot.widget.viewport(), point.toPoint())
        _wait(app, lambda: view.plot.hover_text() != "")
    window.grab().save(str(out))
    window.close()


def main(folder: str, only: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from dcpstudio.core.ops.demo import write_demo

    app = QApplication([])
    where = Path(folder)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as settings:
        for fmt in (QSettings.Format.NativeFormat, QSettings.Format.IniFormat):  # never the user's settings
            QSettings.setPath(fmt, QSettings.Scope.UserScope, settings)
        wanted = set(only or SHOTS)
        if "screenshot" in wanted:
            chunks(app, Path(tmp), where / "screenshot.png")
        if wanted & {"explorer", "compare"}:
            demo_pt, demo = write_demo(Path(tmp) / "demo")
            if "explorer" in wanted:
                explorer(app, demo, where / "explorer.png")
            if "compare" in wanted:
                compare(app, demo, demo_pt, Path(tmp), where / "compare.png")
        if "run" in wanted:
            run_view(app, Path(tmp), where / "run.png")
    for name in SHOTS:
        if name in wanted:
            print(where / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "resources", sys.argv[2:]))
