"""Distributed conversion, side by side: ``dcpstudio convert`` on 1 process vs ``--ranks 2``, and
torch's own multi-rank consolidation (``consolidate_safetensors_files_on_every_rank``, which splits
the work by output file) on 2 ranks as the anchor.

Two cases, each a whole command from launch to exit (start-up, imports and the ranks' start
included), contenders alternated round by round:

* ``cast``: a CPU-bound conversion -- a 2 GiB fp32 torch.save file (16 tensors of 128 MiB) to
  safetensors with ``--dtype bf16``. torch's consolidation has no cast, so it has no anchor here.
* ``skewed``: one tensor is half the bytes -- a 2 GiB bf16 torch.save file (one 1 GiB tensor and
  64 of 16 MiB) to one safetensors file; torch's consolidation gets the same tensors as a
  distributed HF shard (``DCP_SHARDING_INFO``) and writes the same single file.

Two times each: the whole command, and the conversion alone after start-up (the slowest rank's, for
ranks) -- the start-up of ranks (a fresh interpreter importing torch) is paid once per command
whatever the size, the conversion is what more ranks divide. Per-rank bytes are what each rank
wrote (ours: the summary ``--ranks`` prints; torch's: the output
files each rank was assigned), with their spread from the mean.

    python tests/perf/bench_scale.py --rounds 3
    python tests/perf/bench_scale.py --rounds 3 --manifest   # ours with their manifests (one process and ranks)
    python tests/perf/bench_scale.py --baseline /path/to/python   # + an earlier version (that interpreter's dcpstudio)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAKER = r"""
import json, sys, torch
import safetensors.torch as st
case, out, shard_dir = sys.argv[1:4]
g = torch.Generator().manual_seed(0)
if case == "cast":
    sd = {f"layers.{i}.w": torch.randn(4096, 8192, generator=g) for i in range(16)}
else:
    sd = {"embed": torch.randn(32768, 16384, generator=g).to(torch.bfloat16)}
    sd.update({f"layers.{i}.w": torch.randn(2048, 4096, generator=g).to(torch.bfloat16) for i in range(64)})
torch.save(sd, out)
if shard_dir != "-":
    info = {k: {"saved_offsets": [0] * v.dim()} for k, v in sd.items()}
    st.save_file(sd, shard_dir + "/shard-00000-model-00001-of-00001.safetensors",
                 metadata={"DCP_SHARDING_INFO": json.dumps(info)})
print(json.dumps({"tensors": len(sd), "largest": max(v.nbytes for v in sd.values())}))
"""

TORCH_ANCHOR = r"""
import json, os, sys, time, torch.distributed as dist
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank
from safetensors import safe_open
src, dst = sys.argv[1:3]
dist.init_process_group("gloo")
with safe_open(os.path.join(src, os.listdir(src)[0]), "pt") as f:
    names = list(f.keys())
t0 = time.perf_counter()
consolidate_safetensors_files_on_every_rank(src, dst, {n: 1 for n in names})  # one output file, as ours
rank, world = dist.get_rank(), dist.get_world_size()
mine = sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst) if f.endswith(".safetensors")) \
    if 1 % world == rank else 0  # torch gives output file i to rank i % world
print(json.dumps({"rank": rank, "bytes": mine, "seconds": time.perf_counter() - t0}), flush=True)
dist.destroy_process_group()
"""


WRITE_ONLY = r"""
import mmap, os, sys, threading
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.ftruncate(fd, size)
def half(k):
    out, buf = os.open(path, os.O_WRONLY | os.O_DIRECT), mmap.mmap(-1, 16 << 20)
    for at in range(k * size // 2, (k + 1) * size // 2, 16 << 20):
        os.pwrite(out, buf, at)
    os.close(out)
threads = [threading.Thread(target=half, args=(k,)) for k in (0, 1)]
[t.start() for t in threads]
[t.join() for t in threads]
os.fsync(fd)
"""


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])}… failed:\n{out.stderr[-3000:]}")
    return seconds, out.stdout


def _ours_shares(stdout: str) -> list[int]:
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    found = re.findall(r"rank \d+: ([\d.]+) (B|KiB|MiB|GiB|TiB)", stdout)
    return [int(float(n) * units[u]) for n, u in found]


def _spread(shares: list[int]) -> str:
    if not shares:
        return "-"
    mean = sum(shares) / len(shares)
    worst = max(abs(s - mean) for s in shares) / mean * 100 if mean else 0.0
    return f"{' / '.join(f'{s / 2**30:.2f}' for s in shares)} GiB (max {worst:.1f}% off the mean)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--manifest", action="store_true", help="ours write their manifest (default: --no-manifest)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one on the work disk)")
    parser.add_argument("--baseline", default=None, help="a Python with an earlier dcpstudio, run alongside")
    parser.add_argument("--case", choices=("cast", "skewed"), action="append", help="only this case (repeatable)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir or os.path.expanduser("~")))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    results: dict[tuple[str, str], list[float]] = {}
    work: dict[tuple[str, str], list[float]] = {}  # the conversion after start-up: what more ranks divide
    shares: dict[tuple[str, str], list[int]] = {}
    try:
        for case in args.case or ("cast", "skewed"):
            src = root / f"{case}.pt"
            shard_dir = root / f"{case}_shards"
            shard_dir.mkdir()
            maker = [sys.executable, "-c", MAKER, case, str(src), str(shard_dir) if case == "skewed" else "-"]
            info = json.loads(_run(maker, env)[1])
            print(f"{case}: {src.stat().st_size / 2**30:.2f} GiB, {info['tensors']} tensors, "
                  f"largest {info['largest'] / 2**30:.2f} GiB")  # fmt: skip
            extra = [*(["--dtype", "bf16"] if case == "cast" else []), *([] if args.manifest else ["--no-manifest"])]
            contenders = {
                "dcpstudio, 1 process": lambda dst, extra=extra, src=src: [
                    sys.executable, "-m", "dcpstudio", "convert", str(src), str(dst), *extra],
                "dcpstudio --ranks 1": lambda dst, extra=extra, src=src: [
                    sys.executable, "-m", "dcpstudio", "convert", str(src), str(dst), *extra, "--ranks", "1"],
                "dcpstudio --ranks 2": lambda dst, extra=extra, src=src: [
                    sys.executable, "-m", "dcpstudio", "convert", str(src), str(dst), *extra, "--ranks", "2"],
                "the output's bytes alone": lambda dst, case=case: [
                    sys.executable, "-c", WRITE_ONLY, str(dst), str((1 if case == "cast" else 2) << 30)],
            }  # fmt: skip
            if args.baseline:
                earlier = [args.baseline, "-m", "dcpstudio", "convert", str(src)]
                ranks = [*extra, "--ranks", "2"]
                contenders["earlier, 1 process"] = lambda dst, e=earlier, extra=extra: [*e, str(dst), *extra]
                contenders["earlier --ranks 2"] = lambda dst, e=earlier, extra=ranks: [*e, str(dst), *extra]
            if case == "skewed":
                anchor = root / "anchor.py"
                anchor.write_text(TORCH_ANCHOR)
                contenders["torch consolidate, 2 ranks"] = lambda dst, shard_dir=shard_dir, anchor=anchor: [
                    *torchrun, str(anchor), str(shard_dir), str(dst)]  # fmt: skip
            for r in range(args.rounds):
                order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
                for name in order:
                    dst = root / "out.safetensors" if "torch" not in name else root / "out_dir"
                    if "torch" in name:
                        dst.mkdir()
                    with open("/proc/loadavg") as f:
                        load = f.read().split()[0]
                    seconds, stdout = _run(contenders[name](dst), env)
                    if name.startswith("the output"):  # what the disk takes for the output's bytes
                        shares[(case, name)] = [dst.stat().st_size]
                        busy = seconds
                    elif "torch" in name:
                        t0 = time.perf_counter()
                        os.sync()  # torch's writer does not flush; ours fsyncs before it returns
                        seconds += time.perf_counter() - t0
                        rows = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", stdout)]  # lines may interleave
                        shares[(case, name)] = [row["bytes"] for row in sorted(rows, key=lambda x: x["rank"])]
                        busy = max(row["seconds"] for row in rows)
                    elif "ranks" in name:
                        shares[(case, name)] = _ours_shares(stdout)
                        busy = max(float(x) for x in re.findall(r"piece[s]?, ([\d.]+) s", stdout))
                    else:
                        shares[(case, name)] = [dst.stat().st_size]
                        busy = float(re.findall(r" in ([\d.]+) s", stdout)[0])
                    work.setdefault((case, name), []).append(busy)
                    results.setdefault((case, name), []).append(seconds)
                    print(
                        f"  round {r + 1} {name:<28} {seconds:6.2f} s, converting {busy:6.2f} s  (load {load})",
                        flush=True,
                    )
                    shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            src.unlink()
            shutil.rmtree(shard_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'case':<8} {'contender':<28} {'whole command':>14} {'converting':>16}  per-rank bytes")
    for (case, name), times in results.items():
        base = statistics.median(results[(case, "dcpstudio, 1 process")])
        base_work = statistics.median(work[(case, "dcpstudio, 1 process")])
        med, busy = statistics.median(times), statistics.median(work[(case, name)])
        print(
            f"{case:<8} {name:<28} {med:6.2f}s {med / base:5.2f}x {busy:7.2f}s {busy / base_work:5.2f}x  "
            f"{_spread(shares[(case, name)])}"
        )
    print("converting: ours, the time the summary reports (1 process: after start-up; ranks: the slowest rank,")
    print("after the ranks joined); torch's, the consolidation call on its slowest rank; the output's bytes")
    print("alone: as many bytes written as 2 ranks write them (a pre-sized file, a thread per half, 16 MiB")
    print("blocks past the page cache, fsync), with nothing to read or compute")
    for case in args.case or ("cast", "skewed"):
        one, disk = results.get((case, "dcpstudio, 1 process")), results.get((case, "the output's bytes alone"))
        if one and disk:  # 2 ranks cannot beat the start-up one process pays, plus half its work or the disk
            base, busy = statistics.median(one), statistics.median(work[(case, "dcpstudio, 1 process")])
            floor = base - busy + max(busy / 2, statistics.median(disk))
            print(
                f"{case}: the least 2 ranks could take here, start-up {base - busy:.2f} s + the larger of half the "
                f"conversion and the disk's write {floor:.2f} s ({floor / base:.2f}x)"
            )
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {f.read().strip()}")


if __name__ == "__main__":
    main()
