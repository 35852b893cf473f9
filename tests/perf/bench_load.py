"""Multi-rank load of a torch.save file: DCP Studio's TorchSaveReader vs torch's
BroadcastingTorchSaveReader, side by side in one run (4 gloo ranks by default).

Ours loads into a ``shard0`` layout (DTensors, rows sharded) and checks every shard; torch's
reader deadlocks on sharded DTensor targets (shared/FINDINGS.md), so it loads into full,
replicated plain tensors -- the case it supports. Reports the bytes the coordinator sends and
every rank's peak RSS.

    python tests/perf/bench_load.py [--size 1GiB] [--ranks 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def torch_rank(rank: int, world: int, report: Any, path: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner

    from dcpstudio.core import open_checkpoint

    with open_checkpoint(path) as ckpt:  # shapes only, to build the target
        shapes = {f: (e.dtype, e.shape) for f, e in ckpt.entries.items() if e.kind == "tensor"}
    target = {f: torch.empty(s, dtype=d) for f, (d, s) in shapes.items()}
    sent = [0]
    real = dist.broadcast

    def counting(tensor: Any, src: int, *args: Any, **kwargs: Any) -> Any:
        if rank == src:
            sent[0] += tensor.numel() * tensor.element_size() * (world - 1)
        return real(tensor, src, *args, **kwargs)

    dist.broadcast = counting  # type: ignore[assignment]
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(), checkpoint_id=path)
    return {"seconds": time.perf_counter() - t0, "sent": sent[0], "rss": _peak_rss()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()

    import torch

    from dcpstudio.core.convert import parse_size
    from dcpstudio.core.demo import llama_like_state_dict
    from dcpstudio.core.launch import launch
    from dcpstudio.core.load import run_load

    with tempfile.TemporaryDirectory(prefix="dcpstudio-load-") as tmp:
        path = Path(tmp) / "model.pt"
        sd = llama_like_state_dict(parse_size(args.size))
        largest = max(t.numel() * t.element_size() for t in sd["model"].values())
        torch.save(sd, path)
        del sd
        size = path.stat().st_size
        print(f"checkpoint {size / 2**30:.2f} GiB, largest tensor {largest / 2**20:.1f} MiB, {args.ranks} gloo ranks")

        t0 = time.perf_counter()
        ours = run_load(path, ranks=args.ranks, layout="shard0", timeout=1200)
        ours_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = launch(torch_rank, (str(path),), nprocs=args.ranks, timeout=1200)
        theirs_wall = time.perf_counter() - t0

        sent = sum(r.bytes_sent for r in ours)
        print(f"\n{'reader':34} {'sent':>10} {'/ ckpt':>7} {'load s':>7} {'RSS rank 0':>11} {'RSS others (max)':>17}")
        print(
            f"{'dcpstudio TorchSaveReader, shard0':34} {sent / 2**20:8.0f}Mi {sent / size:6.2f}x "
            f"{max(r.seconds for r in ours):7.2f} {ours[0].peak_rss / 2**20:9.0f}Mi "
            f"{max(r.peak_rss for r in ours[1:]) / 2**20:15.0f}Mi"
        )
        print(
            f"{'torch BroadcastingTorchSaveReader':34} {theirs[0]['sent'] / 2**20:8.0f}Mi "
            f"{theirs[0]['sent'] / size:6.2f}x "
            f"{max(r['seconds'] for r in theirs):7.2f} {theirs[0]['rss'] / 2**20:9.0f}Mi "
            f"{max(r['rss'] for r in theirs[1:]) / 2**20:15.0f}Mi  (full replicated targets)"
        )
        print(
            f"\nwall incl. spawn: ours {ours_wall:.1f} s, torch {theirs_wall:.1f} s; "
            f"all shards checked: {all(r.ok for r in ours)}"
        )
        for r in ours:
            bound = 300 * 2**20 + r.local_bytes + 2 * largest
            print(
                f"  rank {r.rank}: peak RSS {r.peak_rss / 2**20:.0f} MiB, bound 300 MiB + shard "
                f"{r.local_bytes / 2**20:.0f} MiB + 2 x largest = {bound / 2**20:.0f} MiB -> "
                f"{'ok' if r.peak_rss <= bound else 'OVER'}"
            )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
