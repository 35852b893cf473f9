"""GUI responsiveness during conversions: a 10 ms QTimer heartbeat on the GUI thread while the
window converts a 1 GiB checkpoint in each direction; prints the largest gap (target < 100 ms).

    QT_QPA_PLATFORM=offscreen python tests/perf/bench_gui.py [--size 1GiB]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    args = ap.parse_args()

    import torch
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from dcpstudio.core import torch_save_to_dcp
    from dcpstudio.core.ops.convert.convert import parse_size
    from dcpstudio.core.ops.demo import llama_like_state_dict
    from dcpstudio.window.main_window import MainWindow

    app = QApplication([])
    with tempfile.TemporaryDirectory(prefix="dcpstudio-gui-") as tmp:
        work = Path(tmp)
        torch.save(llama_like_state_dict(parse_size(args.size)), work / "src.pt")
        torch_save_to_dcp(work / "src.pt", work / "src_dcp")
        window = MainWindow()
        window.show()
        print(f"{'conversion':28} {'wall':>8} {'beats':>6} {'max gap':>9} {'p99 gap':>9}")
        for name, target, src in (
            ("torch.save -> DCP", "dcp", work / "src.pt"),
            ("DCP -> torch.save", "torch", work / "src_dcp"),
            ("DCP -> safetensors", "safetensors", work / "src_dcp"),
        ):
            dst = work / f"out_{target}"
            gaps: list[float] = []
            last = [time.monotonic()]

            def beat(gaps: list[float] = gaps, last: list[float] = last) -> None:
                now = time.monotonic()
                gaps.append(now - last[0])
                last[0] = now

            timer = QTimer()
            timer.setInterval(10)
            timer.timeout.connect(beat)
            window.choose_destination = lambda t, s, dst=dst: dst  # type: ignore[method-assign]
            t0 = time.monotonic()
            timer.start()
            job = window.convert(target, src)
            assert job is not None
            while "convert" not in window.jobs or window.jobs["convert"].running:
                app.processEvents()
                time.sleep(0.001)
            timer.stop()
            wall = time.monotonic() - t0
            gaps = gaps[1:]
            p99 = statistics.quantiles(gaps, n=100)[98] if len(gaps) > 100 else max(gaps)
            print(f"{name:28} {wall:7.2f}s {len(gaps):6d} {max(gaps) * 1000:7.1f}ms {p99 * 1000:7.1f}ms")
        window.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
