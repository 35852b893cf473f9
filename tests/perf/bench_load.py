"""Multi-rank load throughput, side by side in one run (4 gloo ranks by default):

* ours: a torch.save file loaded with ``dcpstudio.core.ranks.load.run_load`` (CheckpointReader) into
  ``shard0`` and ``fsdp`` DTensor targets, every shard checked against the source -- as it runs by
  default (ranks that see the file read their own regions, safely, like torch's ranks), and
  streamed (``local_reads=False``: the coordinator reads everything and sends each rank its
  regions, as it must when the ranks cannot see the file);
* torch's ``dcp.load`` with its ``FileSystemReader`` from DCP directories of the same state dict,
  written by torch's ``dcp.save`` from the same ranks in the *same* DTensor layout, so each rank
  reads only its own shard files into the same targets -- the fastest case torch has;
* torch's ``BroadcastingTorchSaveReader`` on the same torch.save file, into full replicated
  plain tensors (on sharded DTensor targets it deadlocks; shared/FINDINGS.md).

``fsdp`` on a 1-D mesh is ``shard0``; with an even number of ranks (> 2) it runs on a 2-D mesh
(2 x ranks/2: rows over the first dimension, columns over the second), so its regions are not
contiguous in the file. Load time is ``dcp.load`` alone (slowest rank); start-up (start, imports,
joining the process group) is reported apart. Each round runs every reader once, interleaved;
figures are medians over rounds (this machine is shared and noisy).

    python tests/perf/bench_load.py [--size 1GiB] [--ranks 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 1.25  # ours / torch dcp.load
BASE_RSS = 300 << 20  # the per-rank memory bound: this + local shard bytes + 2 x largest tensor


def _structure(path: str) -> dict[str, Any]:
    from dcpstudio.core import open_checkpoint

    with open_checkpoint(path) as ckpt:
        return {f: (e.dtype, e.shape) if e.kind == "tensor" else None for f, e in ckpt.entries.items()}


def _ready(entered: float) -> float:
    from dcpstudio.core.ranks.launch import startup_seconds

    return (startup_seconds() or 0.0) + time.perf_counter() - entered


def save_rank(rank: int, world: int, report: Any, path: str, out: str, layout: str, mesh: tuple[int, ...]) -> float:
    """torch's dcp.save of the torch.save file's state dict, in ``layout`` on ``mesh``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dcpstudio.core.pickles.tree import flatten_state_dict
    from dcpstudio.core.ranks.load import build_target

    target = build_target(_structure(path), layout, init_device_mesh("cpu", mesh))
    full, _ = flatten_state_dict(torch.load(path, mmap=True, weights_only=True))
    for fqn, value in target.items():
        if isinstance(value, DTensor):
            for chunk in value.__create_chunk_list__():
                value.to_local().copy_(narrow_tensor_by_index(full[fqn], chunk.offsets, chunk.sizes))
        else:
            target[fqn] = full[fqn]
    t0 = time.perf_counter()
    dcp.save(target, checkpoint_id=out)
    return time.perf_counter() - t0


def torch_dcp_rank(
    rank: int, world: int, report: Any, path: str, dcp_dir: str, layout: str, mesh: tuple[int, ...]
) -> dict[str, float]:
    entered = time.perf_counter()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcpstudio.core.ranks.load import _peak_rss, build_target

    startup = _ready(entered)
    target = build_target(_structure(path), layout, init_device_mesh("cpu", mesh))
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=dcp_dir)
    return {"seconds": time.perf_counter() - t0, "startup": startup, "rss": _peak_rss(), "sent": 0}


def torch_broadcast_rank(rank: int, world: int, report: Any, path: str) -> dict[str, float]:
    entered = time.perf_counter()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner

    from dcpstudio.core.ranks.load import _peak_rss

    startup = _ready(entered)
    specs = {f: spec for f, spec in _structure(path).items() if spec is not None}
    target = {f: torch.empty(shape, dtype=dtype.torch) for f, (dtype, shape) in specs.items()}
    sent = [0]
    real = dist.broadcast

    def counting(tensor: Any, src: int, *args: Any, **kwargs: Any) -> Any:
        if rank == src:
            sent[0] += tensor.numel() * tensor.element_size() * (world - 1)
        return real(tensor, src, *args, **kwargs)

    dist.broadcast = counting  # type: ignore[assignment]
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(), checkpoint_id=path)
    return {"seconds": time.perf_counter() - t0, "startup": startup, "rss": _peak_rss(), "sent": sent[0]}


def _med(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    from dcpstudio.core.ops.convert.convert import parse_size
    from dcpstudio.core.ops.demo import llama_like_state_dict
    from dcpstudio.core.ranks.launch import launch
    from dcpstudio.core.ranks.load import run_load

    n = args.ranks
    meshes = {"shard0": (n,), "fsdp": (2, n // 2) if n > 2 and n % 2 == 0 else (n,)}
    with tempfile.TemporaryDirectory(prefix="dcpstudio-load-") as tmp:
        path = Path(tmp) / "model.pt"
        sd = llama_like_state_dict(parse_size(args.size))
        largest = max(t.numel() * t.element_size() for t in sd["model"].values())
        torch.save(sd, path)
        entries = len(sd["model"]) + len(sd) - 1
        del sd
        size = path.stat().st_size
        mesh_text = "x".join(map(str, meshes["fsdp"]))
        print(
            f"checkpoint {size / 2**30:.2f} GiB ({entries} entries), largest tensor {largest / 2**20:.1f} MiB, "
            f"{n} gloo ranks, fsdp on a {mesh_text} mesh, {args.rounds} round(s): medians"
        )
        t0 = time.perf_counter()
        dirs, saved = {}, []
        for layout, mesh in meshes.items():
            dirs[layout] = str(Path(tmp) / f"dcp_{layout}")
            saved.append(max(launch(save_rank, (str(path), dirs[layout], layout, mesh), nprocs=n, timeout=1200)))
        print(
            f"DCP directories written by torch's dcp.save from {n} ranks in the same layouts "
            f"(dcp.save {saved[0]:.1f} s + {saved[1]:.1f} s; {time.perf_counter() - t0:.1f} s with the ranks' "
            "start, the first including the fork server's one-time import of torch + DCP)"
        )

        rows: dict[str, list[dict[str, float]]] = {}
        ours: dict[str, list[Any]] = {}
        for rnd in range(args.rounds):
            for layout, mesh in meshes.items():
                for mode, local in (("", True), (" streamed", False)):
                    reports = run_load(
                        path, ranks=n, layout=layout, mesh="x".join(map(str, mesh)), timeout=1200, local_reads=local
                    )
                    assert all(r.ok for r in reports), f"{layout}{mode}: shards differ from the source"
                    ours.setdefault(layout + mode, []).append(reports)
                    rows.setdefault(f"ours {layout}{mode}", []).append(
                        {
                            "seconds": max(r.seconds for r in reports),
                            "startup": max(r.startup for r in reports),
                            "rss": max(r.peak_rss for r in reports),
                            "sent": sum(r.bytes_sent for r in reports),
                        }
                    )
                theirs = launch(torch_dcp_rank, (str(path), dirs[layout], layout, mesh), nprocs=n, timeout=1200)
                rows.setdefault(f"torch {layout}", []).append(_slowest(theirs))
            rows.setdefault("broadcast", []).append(_slowest(launch(torch_broadcast_rank, (str(path),), nprocs=n)))
            print(f"  round {rnd + 1}: " + ", ".join(f"{k} {v[-1]['seconds']:.2f} s" for k, v in rows.items()))

        labels = {
            "ours shard0": "dcpstudio, torch.save -> shard0",
            "ours shard0 streamed": "dcpstudio streamed, torch.save -> shard0",
            "torch shard0": "torch dcp.load, DCP dir -> shard0",
            "ours fsdp": f"dcpstudio, torch.save -> fsdp {mesh_text}",
            "ours fsdp streamed": f"dcpstudio streamed, torch.save -> fsdp {mesh_text}",
            "torch fsdp": f"torch dcp.load, DCP dir -> fsdp {mesh_text}",
            "broadcast": "torch BroadcastingTorchSaveReader",
        }
        print(f"\n{'reader, source -> layout':44} {'load s':>7} {'start-up s':>10} {'sent':>9} {'RSS max':>8}")
        for key, label in labels.items():
            r = rows[key]
            print(
                f"{label:44} {_med([x['seconds'] for x in r]):7.2f} {_med([x['startup'] for x in r]):10.2f} "
                f"{_med([x['sent'] for x in r]) / 2**20:7.0f}Mi {_med([x['rss'] for x in r]) / 2**20:6.0f}Mi"
                + ("  (full replicated targets)" if key == "broadcast" else "")
            )
        print()
        ok = True
        for layout in meshes:
            torch_s = _med([x["seconds"] for x in rows[f"torch {layout}"]])
            ratio = _med([x["seconds"] for x in rows[f"ours {layout}"]]) / torch_s
            streamed = _med([x["seconds"] for x in rows[f"ours {layout} streamed"]]) / torch_s
            ok &= ratio <= TARGET
            verdict = "ok" if ratio <= TARGET else "SLOWER"
            print(
                f"ours / torch dcp.load, {layout}: {ratio:.2f}x (target <= {TARGET}x) -> {verdict}; "
                f"streamed {streamed:.2f}x"
            )
        for layout, runs in ours.items():
            over = [
                (r.rank, r.peak_rss, BASE_RSS + r.local_bytes + 2 * largest)
                for reports in runs
                for r in reports
                if r.peak_rss > BASE_RSS + r.local_bytes + 2 * largest
            ]
            worst = max((r for reports in runs for r in reports), key=lambda r: r.peak_rss - r.local_bytes)
            bound = BASE_RSS + worst.local_bytes + 2 * largest
            ok &= not over
            print(
                f"RSS bound, {layout:16} every rank of every round <= 300 MiB + its shard + 2 x largest: "
                f"{'ok' if not over else f'OVER on {len(over)}'} (tightest: rank {worst.rank} "
                f"{worst.peak_rss / 2**20:.0f} MiB of {bound / 2**20:.0f} MiB)"
            )
    return 0 if ok else 1


def _slowest(results: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(r[k] for r in results) if k != "sent" else sum(r[k] for r in results) for k in results[0]}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
