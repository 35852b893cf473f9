"""Side-by-side conversion benchmark: DCP Studio vs torch's format_utils vs ``cp`` + ``sync``.

Makes a synthetic llama-like checkpoint (bf16 matrices, fp32 norms, ~110 tensors) of ``--size``
bytes, then, alternating the contenders round by round, runs each conversion in a fresh process.
Two ways of timing, side by side:

* in-process: wall time around the conversion call, after the imports (a long-lived app);
* whole process: the command a user types -- ``dcpstudio convert`` and torch's
  ``python -m torch.distributed.checkpoint.format_utils`` -- from launch to exit, start-up and
  imports included, peak RSS from ``wait4``.

Peak RSS in-process is the process's ``VmHWM`` (``ru_maxrss`` would inherit the parent's peak
across fork). ``cp SRC DST && sync DST`` of the same bytes is the yardstick. Prints a table with
ratios.

    python tests/perf/bench_convert.py --size 2GiB --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNER = r"""
import json, os, resource, sys, time
mode, src, dst = sys.argv[1:4]
import torch, torch.distributed.checkpoint  # imported before timing, as a long-lived app would
if mode.startswith("ours"):
    from dcpstudio.core import convert, torch_save_to_dcp, dcp_to_torch_save
    to_safetensors = lambda src, dst: convert(src, dst, to="safetensors")
else:
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp, dcp_to_torch_save
fn = {"to_dcp": torch_save_to_dcp, "to_torch": dcp_to_torch_save}.get(mode.split("_", 1)[1]) or to_safetensors
t0 = time.perf_counter()
fn(src, dst)
if mode.startswith("torch"):
    os.sync()  # torch.save does not flush; ours and cp+sync do
wall = time.perf_counter() - t0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
rss = int(hwm[0].split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"wall": wall, "rss": rss}))
"""


MAKER = r"""
import json, sys, warnings
import torch
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
from dcpstudio.core.ops.demo import llama_like_state_dict
warnings.simplefilter("ignore")
size, src_pt, src_dcp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sd = llama_like_state_dict(size)
info = [len(sd["model"]), max(t.numel() * t.element_size() for t in sd["model"].values())]
torch.save(sd, src_pt)
del sd
torch_save_to_dcp(src_pt, src_dcp)  # the DCP source is written by torch itself
print(json.dumps(info))
"""


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def run_python(mode: str, src: Path, dst: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, mode, str(src), str(dst)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_command(who: str, direction: str, src: Path, dst: Path) -> dict[str, float]:
    """The whole command, from launch to exit (start-up and imports included)."""
    if who.startswith("ours"):
        to = {"to_dcp": "dcp", "to_torch": "torch", "to_st": "safetensors"}[direction]
        cmd = [sys.executable, "-m", "dcpstudio", "convert", str(src), str(dst), "--to", to, "-q"]
        cmd += ["--no-manifest"] if who == "ours-nomf-cli" else []
    else:
        name = {"to_dcp": "torch_to_dcp", "to_torch": "dcp_to_torch"}[direction]
        cmd = [sys.executable, "-m", "torch.distributed.checkpoint.format_utils", name, str(src), str(dst)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if who == "torch-cli":
        subprocess.run(["sync"], check=True)  # torch.save does not flush; ours and cp+sync do
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return {"wall": wall, "rss": usage.ru_maxrss * 1024}


def run_cp(src: Path, dst: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    cmd = ["cp", "-r", str(src), str(dst)]
    subprocess.run(cmd, check=True)
    subprocess.run(["sync", str(dst)] if dst.is_file() else ["sync"], check=True)
    return {"wall": time.perf_counter() - t0, "rss": float("nan")}


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="work directory (default: a temporary directory under /tmp)")
    ap.add_argument("--skip-torch", action="store_true", help="leave torch's format_utils out (it is slow)")
    args = ap.parse_args()

    size = parse_size(args.size)
    work = Path(args.dir or tempfile.mkdtemp(prefix="dcpstudio-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src_pt, src_dcp = work / "src.pt", work / "src_dcp"
    # made in a child process: this one stays small, so the children's peak RSS (which Linux
    # carries over from the parent at fork) measures them alone
    made = subprocess.run([sys.executable, "-c", MAKER, str(size), str(src_pt), str(src_dcp)], check=True,
                          capture_output=True, text=True)  # fmt: skip
    n_tensors, largest = json.loads(made.stdout.strip().splitlines()[-1])
    actual = src_pt.stat().st_size
    print(f"checkpoint: {actual / 2**30:.2f} GiB, {n_tensors} tensors, largest {largest / 2**20:.1f} MiB, in {work}")

    directions = {"to_dcp": src_pt, "to_torch": src_dcp, "to_st": src_dcp}  # to_st: DCP -> safetensors
    contenders = ["ours", "ours-cli", "ours-nomf-cli", "cp"] + ([] if args.skip_torch else ["torch", "torch-cli"])
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for direction, src in directions.items():
            for who in order:
                if who.startswith("torch") and direction == "to_st":
                    continue  # torch has no converter to safetensors
                dst = work / f"out_{direction}_{who}"
                remove(dst)
                subprocess.run(["sync"], check=True)  # start from clean page cache writeback, every contender
                if who == "cp":
                    res = run_cp(src, dst)
                elif who.endswith("-cli"):
                    res = run_command(who, direction, src, dst)
                else:
                    res = run_python(f"{who}_{direction}", src, dst)
                results.setdefault((direction, who), []).append(res)
                remove(dst)
                print(f"  round {r + 1} {direction:8} {who:13} {res['wall']:7.2f} s", flush=True)

    print()
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'direction':10} {'tool':32} {'wall (median)':>14} {'vs cp+sync':>11} {'peak RSS':>10}")
    for direction in directions:
        cp_wall = statistics.median(x["wall"] for x in results[(direction, "cp")])
        for who in contenders:
            rows = results.get((direction, who))
            if not rows:
                continue
            wall = statistics.median(x["wall"] for x in rows)
            rss = max(x["rss"] for x in rows)
            name = {
                "ours": "dcpstudio (in-process)",
                "ours-cli": "dcpstudio (whole command)",
                "ours-nomf-cli": "dcpstudio --no-manifest (whole)",
                "cp": "cp + sync",
                "torch": "format_utils (in-process)",
                "torch-cli": "format_utils (whole command)",
            }[who]
            rss_text = "-" if rss != rss else f"{rss / 2**20:.0f} MiB"
            print(f"{direction:10} {name:32} {wall:12.2f} s {wall / cp_wall:10.2f}x {rss_text:>10}")
    if not args.dir:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
