"""``dcpstudio drift RUN`` side by side with ``cat`` of every file of the run: a torchtitan-style run
of ``--steps`` DCP checkpoints (``step-N``) of ``--size`` each (8 x 256 MiB by default: float32 and
bfloat16 tensors, each step the previous plus a small update, as training makes them).

Contenders, alternated round by round, whole commands (start-up included), page cache warm for all
(every file read once before the first measurement) -- or, with ``--cold``, the page cache dropped
before each command (``/proc/sys/vm/drop_caches``: root on Linux), as for a run larger than memory,
whose checkpoints are read from the disk:
- ``cat step-*/* > /dev/null`` -- reading every checkpoint once (the target: drift <= 1.5x this);
- ``dcpstudio drift RUN --json --no-cache`` -- every step computed, nothing cached;
- ``dcpstudio drift RUN --json`` with the cache filled -- re-opening an unchanged run.
With ``--baseline DIR`` (a folder whose ``dcpstudio`` package is an earlier version, found first on
``PYTHONPATH``), that version's ``drift --no-cache`` runs alongside, for before/after figures in one run.
Peak RSS of each command is reported (the bound is a few blocks, whatever the run's size), and the
load average, since the machine may be shared.

    python tests/perf/bench_drift.py [--steps 8] [--size 256MiB] [--rounds 3] [--dir DIR] [--baseline DIR] [--cold]
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


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    for suffix, factor in units.items():
        if text.lower().endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def make_run(root: Path, steps: int, size: int) -> None:
    """``root/step-N``: per step ~``size`` bytes in 8 tensors (6 float32, 2 bfloat16)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    per = size // 8
    shapes = {f"model.layers.{i}.w": (per // 4 // 1024, 1024) for i in range(6)}
    shapes |= {f"model.layers.{i}.w_bf16": (per // 2 // 1024, 1024) for i in (6, 7)}
    state = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    for step in range(1, steps + 1):
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=g), alpha=1e-4)
        saved = {n: (t.bfloat16() if n.endswith("bf16") else t) for n, t in state.items()}
        dcp.save({"model": saved, "train_state": {"step": step}}, checkpoint_id=str(root / f"step-{step}"))


def _drop_caches() -> None:
    """Empties the page cache (dirty pages written first), so the next command reads from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold needs root on Linux to drop the page cache: {e}") from None


def _measure(cmd: str, env: dict[str, str], cold: bool = False) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of one shell command (``cold``: the page cache dropped first)."""
    if cold:
        _drop_caches()
    t0 = time.perf_counter()
    proc = subprocess.Popen(["/bin/sh", "-c", f"exec {cmd}"], env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:  # the run made here is healthy: 1 (anomalies) is as wrong as an error
        raise SystemExit(f"{cmd}: exit {proc.returncode}")
    return wall, usage.ru_maxrss << 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", default="256MiB", help="bytes per checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the run (default: a temporary folder, removed after)")
    ap.add_argument("--baseline", help="a folder holding an earlier dcpstudio package, run alongside")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each command (root)")
    ap.add_argument("--make", help=argparse.SUPPRESS)  # in a child: this process stays small (peak RSS)
    args = ap.parse_args()
    if args.make:
        make_run(Path(args.make), args.steps, _size(args.size))
        return
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_drift_"))
    run, cache = base / "run", base / "cache"
    try:
        if not run.exists():
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--make", str(run), "--steps", str(args.steps), "--size", args.size]
            subprocess.run(cmd, check=True)
            print(f"wrote {args.steps} x {args.size} in {time.perf_counter() - t0:.1f} s: {run}")
        total = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
        env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
        dcpstudio = f"{sys.executable} -m dcpstudio"
        contenders = {
            "cat every file": f"cat {run}/step-*/* {run}/step-*/.metadata",
            "drift, no cache": f"{dcpstudio} drift {run} --json -q --no-cache",
            "drift, cached": f"{dcpstudio} drift {run} --json -q",
        }
        if args.baseline:
            contenders["baseline, no cache"] = (
                f"env PYTHONPATH={args.baseline} {sys.executable} -m dcpstudio drift {run} --json -q --no-cache"
            )
        _measure(contenders["cat every file"], env)  # the page cache warm for everyone
        shutil.rmtree(cache, ignore_errors=True)
        _measure(contenders["drift, cached"], env)  # fills the cache
        walls: dict[str, list[float]] = {k: [] for k in contenders}
        rss: dict[str, int] = dict.fromkeys(contenders, 0)
        for _ in range(args.rounds):
            for name, cmd in contenders.items():
                wall, peak = _measure(cmd, env, cold=args.cold)
                walls[name].append(wall)
                rss[name] = max(rss[name], peak)
        cache_state = "cold (dropped before each command)" if args.cold else "warm"
        print(f"run: {args.steps} checkpoints, {total / 2**20:.0f} MiB in all; page cache {cache_state}; "
              f"{args.rounds} rounds, medians; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
        anchor = statistics.median(walls["cat every file"])
        for name, ws in walls.items():
            m = statistics.median(ws)
            print(f"  {name:<19} {m:7.2f} s  {m / anchor:5.2f}x cat  {total / m / 2**20:7.0f} MiB/s  "
                  f"peak RSS {rss[name] / 2**20:6.0f} MiB  (all: {', '.join(f'{w:.2f}' for w in ws)})")  # fmt: skip
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
