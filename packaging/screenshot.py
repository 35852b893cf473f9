"""Take the README screenshot: the window on a DCP checkpoint saved by 3 gloo ranks.

xvfb-run -s "-screen 0 1600x1000x24" python packaging/screenshot.py resources/screenshot.png
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(out: str) -> int:
    sys.path.insert(0, str(ROOT))
    from PySide6.QtWidgets import QApplication

    from dcpstudio.window.main_window import MainWindow
    from tests import _ranks

    app = QApplication([])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "llama_3ranks_dcp"
        _ranks.save_sharded_model(ckpt, world=3)
        window = MainWindow()
        window.browser.set_root(tmp)
        window.resize(1560, 940)
        window.show()
        window.open_path(ckpt)
        while window.ckpt is None:
            app.processEvents()
        window.tree.expandToDepth(2)
        window.select("model.layers.0.feed_forward.w1.weight")
        while "min" not in window.details.stats_label.text():
            app.processEvents()
        for _ in range(20):
            app.processEvents()
        window.grab().save(out)
        window.close()
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "resources/screenshot.png"))
