"""Start-up benchmark: how soon the window paints and shows a tree, and how fast the command line
answers, beside bare ``python -c "import torch"`` and ``python -c "import PySide6.QtWidgets"`` --
measured side by side in one run, warm cache (pages and bytecode), whole processes.

* window: launch of ``dcpstudio`` (no arguments, ``dcpstudio open <DCP dir>`` and ``dcpstudio
  --demo``) to its first paint, and for the last two to the first paint of the tree with its rows
  (the user sees the checkpoint), reported by the window itself through
  ``DCPSTUDIO_STARTUP_TRACE`` (same wall clock); the demo both on a first launch (its files not
  yet written) and on a later one;
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
import shutil
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
from dcpstudio.core.ops.demo import llama_like_state_dict
work = sys.argv[1]
sd = llama_like_state_dict(64 << 20)
torch.save(sd, f"{work}/model.pt")
torch_save_to_dcp(f"{work}/model.pt", f"{work}/model_dcp")
save_file({k: v.contiguous() for k, v in sd["model"].items() if k != "output.weight"}, f"{work}/model.safetensors")
"""


PYCACHE = Path(tempfile.gettempdir()) / "dcpstudio-bench-pycache"


def child_env(**extra: str) -> dict[str, str]:
    """The children's environment: bytecode is cached (in PYCACHE), as after a pip install, even
    where ``PYTHONDONTWRITEBYTECODE`` is set -- else every launch would compile every module."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(PYCACHE), **extra}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def whole(cmd: list[str]) -> float:
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    return time.time() - t0


def traced(args: list[str], work: Path, data: Path, mark: str) -> float:
    """Seconds from launch to the window's ``mark`` ("paint" or "tree"), as the window reports it;
    the window is closed (SIGTERM: its Quit path) as soon as it has been seen."""
    trace = work / "startup_trace.txt"
    trace.unlink(missing_ok=True)
    env = child_env(DCPSTUDIO_STARTUP_TRACE=str(trace), XDG_CONFIG_HOME=str(work / "config"), XDG_DATA_HOME=str(data))
    t0 = time.time()
    child = subprocess.Popen(
        [sys.executable, "-m", "dcpstudio", "--quit-after", "30", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while child.poll() is None:
            marks = dict(line.split() for line in trace.read_text().splitlines()) if trace.exists() else {}
            if mark in marks:
                return float(marks[mark]) - t0
            time.sleep(0.005)
        raise RuntimeError(f"dcpstudio {' '.join(args)} ended (exit {child.returncode}) before its {mark!r} mark")
    finally:
        child.terminate()
        child.wait(30)


def demo_first_launch(work: Path, mark: str) -> float:
    """The demo on a fresh data folder: nothing written yet."""
    fresh = Path(tempfile.mkdtemp(dir=work, prefix="data-"))
    try:
        return traced(["--demo"], work, fresh, mark)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def gui_gaps_while_torch_loads() -> tuple[float, float]:
    """(seconds until PyTorch was loaded, longest GUI-thread timer gap meanwhile), in a fresh
    process so that torch is really imported."""
    code = r"""
import sys, time
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication([])
from dcpstudio.window.main_window import MainWindow
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
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=child_env()
    ).stdout
    loaded, gap = (float(x) for x in out.split())
    return loaded, gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=[], help="measure only the lines whose name contains one of these")
    ap.add_argument("--no-gaps", action="store_true", help="skip the GUI-gap measurement while PyTorch loads")
    args = ap.parse_args()
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="dcpstudio-startup-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-c", MAKER, str(work)], check=True)
        dcpstudio = [sys.executable, "-m", "dcpstudio"]
        data = work / "data"  # the demo's files stay here between launches, as in ~/.local/share
        dcp = ["open", str(work / "model_dcp")]
        contenders = {
            'python -c "import PySide6.QtWidgets"': lambda: whole([sys.executable, "-c", "import PySide6.QtWidgets"]),
            'python -c "import torch"': lambda: whole([sys.executable, "-c", "import torch"]),
            "window: dcpstudio -> first paint": lambda: traced([], work, data, "paint"),
            "window: dcpstudio open DCP -> first paint": lambda: traced(dcp, work, data, "paint"),
            "window: dcpstudio open DCP -> tree shown": lambda: traced(dcp, work, data, "tree"),
            "window: dcpstudio --demo -> first paint": lambda: traced(["--demo"], work, data, "paint"),
            "window: dcpstudio --demo -> tree shown": lambda: traced(["--demo"], work, data, "tree"),
            "window: --demo, first launch -> tree shown": lambda: demo_first_launch(work, "tree"),
            "dcpstudio --version": lambda: whole([*dcpstudio, "--version"]),
            "dcpstudio inspect model.safetensors": lambda: whole(
                [*dcpstudio, "inspect", str(work / "model.safetensors")]
            ),
            "dcpstudio inspect model_dcp/": lambda: whole([*dcpstudio, "inspect", str(work / "model_dcp")]),
            "dcpstudio inspect model.pt": lambda: whole([*dcpstudio, "inspect", str(work / "model.pt")]),
        }
        only = [name for name in contenders if not args.only or any(o in name for o in args.only)]
        contenders = {name: contenders[name] for name in only}
        for fn in contenders.values():  # warm the page cache
            fn()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                times[name].append(fn())
        loads = [] if args.no_gaps else [gui_gaps_while_torch_loads() for _ in range(max(1, args.rounds // 2))]
    print(f"{'what':46} {'median':>9} {'min':>9} {'max':>9}")
    for name, values in times.items():
        print(f"{name:46} {statistics.median(values):8.3f}s {min(values):8.3f}s {max(values):8.3f}s")
    if loads:
        print(
            f"{'window: PyTorch loaded in the background after':46} {statistics.median(x[0] for x in loads):8.3f}s"
            f"   longest GUI-thread gap meanwhile: {max(x[1] for x in loads) * 1000:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
