"""``verify`` side by side with reading both checkpoints: a torch.save file of 16 tensors and its DCP
copy (1 GiB each by default), equal, then the same pair with one element changed in every tensor.

Anchors, all with a warm page cache (every file read once before the first measurement):
- ``cat A B > /dev/null`` -- reading both checkpoints' bytes (the target: verify <= 2x this);
- a naive script: ``torch.load`` + ``dcp.load`` + ``torch.equal`` per tensor;
ours in-process (``diff()`` after the imports, as the window and a script run it) and as the whole
``dcpstudio verify`` command (start-up included). Peak RSS beyond the process's start is reported:
the bound is a few blocks (32 MiB each), whatever the checkpoint's size.

    python tests/perf/bench_verify.py [--size 1GiB] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNER = r"""
import json, sys, time
mode, a, b = sys.argv[1:4]

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

import torch
if mode == "naive":
    import torch.distributed.checkpoint as dcp
    base = peak()
    t0 = time.perf_counter()
    x = torch.load(a, weights_only=True)
    y = {k: torch.empty_like(v) for k, v in x.items()}
    dcp.load(y, checkpoint_id=b, no_dist=True)
    equal = all(torch.equal(x[k], y[k]) for k in x)
else:
    from dcpstudio.core import diff, open_checkpoint
    base = peak()
    t0 = time.perf_counter()
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        r = diff(ca, cb, quick=mode == "quick")
    equal = r.equal
print(json.dumps({"wall": time.perf_counter() - t0, "equal": equal, "rss": peak() - base}))
"""


def _median(cmd: list[str], rounds: int) -> tuple[float, dict[str, float]]:
    walls, last = [], {}
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        if cmd[0] == sys.executable and out.stdout.strip():
            last = json.loads(out.stdout.strip().splitlines()[-1])
            walls[-1] = last["wall"]
    return statistics.median(walls), last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    from dcpstudio.core import torch_save_to_dcp
    from dcpstudio.core.ops.convert.convert import parse_size

    per = parse_size(args.size) // 16 // 4
    cols = 4096
    with tempfile.TemporaryDirectory(prefix="dcpstudio-verify-") as tmp:
        work = Path(tmp)
        g = torch.Generator().manual_seed(0)
        sd = {f"layers.{i}.w": torch.randn(per // cols, cols, generator=g) for i in range(16)}
        torch.save(sd, work / "a.pt")
        torch_save_to_dcp(work / "a.pt", work / "a_dcp")
        for i, t in enumerate(sd.values()):
            t[(i * 37) % t.shape[0], 5] += 1  # one element per tensor, at different depths
        torch.save(sd, work / "b.pt")
        torch_save_to_dcp(work / "b.pt", work / "b_dcp")
        del sd
        files = [str(p) for p in sorted(work.rglob("*")) if p.is_file()]
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        size = (work / "a.pt").stat().st_size
        a_files = [str(work / "a.pt"), *(str(p) for p in sorted((work / "a_dcp").iterdir()))]
        print(f"A: torch.save {size / 2**30:.2f} GiB (16 fp32 tensors), B: its DCP copy; medians of {args.rounds}")
        cat, _ = _median(["sh", "-c", 'cat "$@" > /dev/null', "cat", *a_files], args.rounds)
        print(f"  {'cat A B > /dev/null (anchor)':48} {cat:6.2f} s")
        rows = [
            ("ours, in-process diff() (target <= 2x cat)", "ours", "a_dcp"),
            ("naive torch.load + dcp.load + torch.equal", "naive", "a_dcp"),
            ("ours, A vs changed B (full report)", "ours", "b_dcp"),
            ("ours, A vs changed B, --quick", "quick", "b_dcp"),
        ]
        for label, mode, other in rows:
            cmd = [sys.executable, "-c", RUNNER, mode, str(work / "a.pt"), str(work / other)]
            wall, last = _median(cmd, args.rounds)
            print(
                f"  {label:48} {wall:6.2f} s  {wall / cat:5.2f}x cat  equal={last.get('equal')}  "
                f"+{last.get('rss', 0) / 2**20:.0f} MiB RSS"
            )
        whole, _ = _median(["dcpstudio", "verify", "-q", str(work / "a.pt"), str(work / "a_dcp")], args.rounds)
        print(
            f"  {'dcpstudio verify A B (whole command, start-up included)':48} {whole:6.2f} s  {whole / cat:5.2f}x cat"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
