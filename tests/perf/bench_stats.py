"""Statistics of one tensor (``tensor_stats``: min, max, mean, std, NaN/Inf/zero counts, a
64-bin histogram) side by side with its anchor: reading the tensor plus one plain torch pass that
computes the same figures on the whole tensor in memory. Target: ours <= 1.5x the anchor, with
peak memory bounded by the block budget (not by the tensor).

Every measurement runs in a fresh process after the file has been read once (warm page cache,
same conditions for all); the figure is the median of ``--rounds``.

    python tests/perf/bench_stats.py [--sizes 64MiB,1GiB] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = r"""
import json, sys, time
mode, path = sys.argv[1:3]
import torch
from dcpstudio.core import open_checkpoint, tensor_stats

def peak():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

with open_checkpoint(path) as ckpt:
    base = peak()
    t0 = time.perf_counter()
    if mode == "ours":
        s = tensor_stats(ckpt, "w", bins=64)
        out = {"wall": time.perf_counter() - t0, "mean": s.mean}
    else:
        x = ckpt.read_tensor("w")
        read = time.perf_counter() - t0
        t1 = time.perf_counter()
        nan, posinf, neginf = torch.isnan(x).sum(), torch.isposinf(x).sum(), torch.isneginf(x).sum()
        good = x[torch.isfinite(x)]  # the figures are those of the finite values, as ours
        lo, hi = torch.aminmax(good)
        zeros = (good == 0).sum()
        std, mean = torch.std_mean(good, correction=0)
        hist = torch.histc(good, bins=64, min=float(lo), max=float(hi))
        out = {"wall": time.perf_counter() - t0, "read": read, "pass": time.perf_counter() - t1, "mean": float(mean)}
    out["extra_rss"] = peak() - base
print(json.dumps(out))
"""


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def _run(mode: str, path: Path, rounds: int) -> dict[str, float]:
    runs = []
    for _ in range(rounds):
        out = subprocess.run(
            [sys.executable, "-c", RUNNER, mode, str(path)], check=True, capture_output=True, text=True
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64MiB,1GiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    head = ("tensor", "read", "1 pass", "anchor", "ours", "ratio", "ours RSS", "anchor RSS")
    print("{:>10} {:>7} {:>7} {:>7} {:>7} {:>6}  {:>9} {:>10}".format(*head))
    with tempfile.TemporaryDirectory(prefix="dcpstudio-stats-") as tmp:
        for text in args.sizes.split(","):
            size = _parse_size(text)
            path = Path(tmp) / f"stats-{text}.pt"
            g = torch.Generator().manual_seed(0)
            w = torch.randn(size // 4 // 1024, 1024, generator=g).mul_(0.02).add_(0.5)
            w[1, 2] = float("nan")  # one block takes the masked path, as real checkpoints sometimes do
            torch.save({"w": w}, path)
            del w
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            anchor = _run("anchor", path, args.rounds)
            ours = _run("ours", path, args.rounds)
            ratio = ours["wall"] / anchor["wall"]
            print(
                f"{text:>10} {anchor['read']:6.2f}s {anchor['pass']:6.2f}s {anchor['wall']:6.2f}s {ours['wall']:6.2f}s "
                f"{ratio:5.2f}x  {ours['extra_rss'] / 2**20:7.0f}Mi {anchor['extra_rss'] / 2**20:8.0f}Mi"
                f"  {'ok' if ratio <= 1.5 else 'OVER 1.5x'}"
            )
            path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
