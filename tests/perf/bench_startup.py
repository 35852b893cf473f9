"""Start-up benchmark: how soon the window paints and how fast the command line answers, beside a
bare ``python -c "import torch"`` -- measured side by side in one run, warm cache, whole processes.

* window: launch of ``dcpstudio`` (no arguments, and ``dcpstudio open <DCP dir>``) to its first
  paint, reported by the window itself through ``DCPSTUDIO_FIRST_PAINT`` (same wall clock);
* GUI responsiveness while PyTorch loads in the background: the longest gap of a 10 ms timer on
  the GUI thread from ``show()`` until the import is done (in this process);
* command line: ``dcpstudio inspect`` of a safetensors file, a DCP directory and a torch.save
  file, and ``dcpstudio --version``, launch to exit.

    QT_QPA_PLATFORM=offscreen python tests/perf/bench_startup.py --rounds 5
    xvfb-run -a python tests/perf/bench_startup.py             # on a real X server
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAKER = r"""
import sys, torch
from safetensors.torch import save_file
from dcpstudio.core import torch_save_to_dcp
from dcpstudio.core.demo import llama_like_state_dict
work = sys.argv[1]
sd = llama_like_state_dict(64 << 20)
torch.save(sd, f"{work}/model.pt")
torch_save_to_dcp(f"{work}/model.pt", f"{work}/model_dcp")
save_file({k: v.contiguous() for k, v in sd["model"].items() if k != "output.weight"}, f"{work}/model.safetensors")
"""


def whole(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.time() - t0


def first_paint(args: list[str], work: Path) -> float:
    stamp = work / "first_paint.txt"
    stamp.unlink(missing_ok=True)
    env = {**os.environ, "DCPSTUDIO_FIRST_PAINT": str(stamp), "XDG_CONFIG_HOME": str(work / "config")}
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "dcpstudio", "--quit-after", "4", *args],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return float(stamp.read_text()) - t0


def gui_gaps_while_torch_loads() -> tuple[float, float]:
    """(seconds until PyTorch was loaded, longest GUI-thread timer gap meanwhile), in a fresh
    process so that torch is really imported."""
    code = r"""
import sys, time
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication([])
from dcpstudio.app.main_window import MainWindow
w = MainWindow(); w.show()
t0 = time.perf_counter(); last = [t0]; gaps = [0.0]
def tick():
    now = time.perf_counter(); gaps.append(now - last[0]); last[0] = now
timer = QTimer(); timer.timeout.connect(tick); timer.start(10)
job = w.load_torch_in_background()
done = []
job.finished.connect(lambda: (done.append(time.perf_counter() - t0), QTimer.singleShot(200, app.quit)))
app.exec()
print(done[0], max(gaps))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded, gap = (float(x) for x in out.split())
    return loaded, gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="dcpstudio-startup-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-c", MAKER, str(work)], check=True)
        dcpstudio = [sys.executable, "-m", "dcpstudio"]
        contenders = {
            'python -c "import torch"': lambda: whole([sys.executable, "-c", "import torch"]),
            "window: dcpstudio -> first paint": lambda: first_paint([], work),
            "window: dcpstudio open DCP -> first paint": lambda: first_paint(["open", str(work / "model_dcp")], work),
            "dcpstudio --version": lambda: whole([*dcpstudio, "--version"]),
            "dcpstudio inspect model.safetensors": lambda: whole(
                [*dcpstudio, "inspect", str(work / "model.safetensors")]
            ),
            "dcpstudio inspect model_dcp/": lambda: whole([*dcpstudio, "inspect", str(work / "model_dcp")]),
            "dcpstudio inspect model.pt": lambda: whole([*dcpstudio, "inspect", str(work / "model.pt")]),
        }
        for fn in contenders.values():  # warm the page cache
            fn()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                times[name].append(fn())
        loads = [gui_gaps_while_torch_loads() for _ in range(max(1, args.rounds // 2))]
    print(f"{'what':46} {'median':>9} {'min':>9} {'max':>9}")
    for name, values in times.items():
        print(f"{name:46} {statistics.median(values):8.3f}s {min(values):8.3f}s {max(values):8.3f}s")
    print(
        f"{'window: PyTorch loaded in the background after':46} {statistics.median(x[0] for x in loads):8.3f}s"
        f"   longest GUI-thread gap meanwhile: {max(x[1] for x in loads) * 1000:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
