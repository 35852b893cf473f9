"""Offline resharding, side by side in one run: a llama-like checkpoint saved by torch's ``dcp.save``
from ``--from`` ranks (matrices ``Shard(0)``, vectors replicated), then for each target (N ranks,
layout, mesh):

* ``reshard``: ``dcpstudio convert SRC DST --for-ranks N --layout L [--mesh M]`` (the whole command,
  start-up included, and its peak RSS), with its manifest (read back from the written chunks) and
  with ``--no-manifest``;
* ``torch load+save``: torch's own way to a copy laid out for N ranks -- ``dcp.load`` on N ranks
  from the original into DTensors of the layout, then ``dcp.save`` of them (the anchor): the two
  calls in the slowest rank, and the whole launch (start-up, imports, process group) beside;
* the load a resumed job does -- torch's ``dcp.load`` (``FileSystemReader``, ``DefaultLoadPlanner``)
  on N ranks into DTensors of the layout -- from the original and from the resharded copy: time of
  the slowest rank, and the data files each rank opens (Python's ``open`` audit event).

Rounds alternate the contenders; figures are medians. The machine is shared: the load average is
printed before and after.

    python tests/perf/bench_reshard.py [--size 512MiB] [--from 3] [--rounds 3] [--reshard-only]

``--reshard-only``: the two ``reshard`` contenders alone (no torch anchor, no loads), and a third
target, ``shard1`` on 3 ranks.
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
from typing import Any

TARGETS = [(2, "shard0", None), (4, "fsdp", "2x2")]
WORST = [(3, "shard1", None)]  # every row in every rank's file: the manifest's pieces read back at the end
COMMAND = [  # `dcpstudio convert`, whole, printing its peak RSS (KiB) last on stderr
    sys.executable,
    "-c",
    "import resource, sys\nfrom dcpstudio.cli.main import main\nrc = main(['convert', *sys.argv[1:]])\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(rc)",
]


def save_rank(rank: int, world: int, report: Any, out: str, size: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcpstudio.core.ops.demo import llama_like_state_dict

    mesh = init_device_mesh("cpu", (world,))
    sd = llama_like_state_dict(size)
    for name, t in sd["model"].items():
        sd["model"][name] = distribute_tensor(t, mesh, [Shard(0)] if t.dim() == 2 else [Replicate()])
    dcp.save(sd, checkpoint_id=out)


def load_rank(rank: int, world: int, report: Any, path: str, layout: str, mesh: tuple[int, ...], save: str) -> Any:
    """dcp.load of ``path`` into DTensors of ``layout``: seconds, files opened; then (``save``) torch's
    dcp.save of them, seconds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.ranks.load import build_target
    from tests._ranks import data_files_opened

    with open_checkpoint(path) as ckpt:
        structure = {f: (e.dtype, e.shape) if e.kind == "tensor" else None for f, e in ckpt.entries.items()}
    target = build_target(structure, layout, init_device_mesh("cpu", mesh))
    dist.barrier()
    t0 = time.perf_counter()
    _, opened = data_files_opened(dcp.load, target, checkpoint_id=path)
    loaded = time.perf_counter() - t0
    saved = 0.0
    if save:
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(target, checkpoint_id=save)
        saved = time.perf_counter() - t0
    return {"load": loaded, "save": saved, "files": len(set(opened)), "opens": len(opened)}


def _load(path: Path, n: int, layout: str, mesh: tuple[int, ...], save: str = "") -> dict[str, Any]:
    from dcpstudio.core.ranks.launch import launch

    t0 = time.perf_counter()
    per_rank = launch(load_rank, (str(path), layout, mesh, save), nprocs=n, timeout=1200)
    return {
        "wall": time.perf_counter() - t0,
        "load": max(r["load"] for r in per_rank),
        "save": max(r["save"] for r in per_rank),
        "files": [r["files"] for r in per_rank],
        "opens": [r["opens"] for r in per_rank],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--from", dest="source_ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reshard-only", action="store_true", help="with and without the manifest, no torch runs")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import shutil

    from dcpstudio.core.ops.convert.convert import parse_size
    from dcpstudio.core.ranks.launch import launch

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; size {args.size}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        src = Path(tmp) / "src"
        t0 = time.perf_counter()
        launch(save_rank, (str(src), parse_size(args.size)), nprocs=args.source_ranks, timeout=1200)
        print(f"source: dcp.save from {args.source_ranks} ranks in {time.perf_counter() - t0:.1f} s")
        for n, layout, mesh_text in TARGETS + (WORST if args.reshard_only else []):
            mesh = tuple(int(x) for x in mesh_text.split("x")) if mesh_text else (n,)
            rows: dict[str, list[dict[str, Any]]] = {}
            dst, ref = Path(tmp) / f"r{n}", Path(tmp) / f"t{n}"
            for round_ in range(args.rounds):
                shutil.rmtree(dst, ignore_errors=True)
                shutil.rmtree(ref, ignore_errors=True)
                cmd = [*COMMAND, str(src), str(dst), "--for-ranks", str(n), "--layout", layout, "-q"]
                cmd += ["--mesh", mesh_text] if mesh_text else []
                pair: list[tuple[str, list[str]]] = [("reshard", []), ("--no-manifest", ["--no-manifest"])]
                for name, extra in pair if round_ % 2 == 0 else pair[::-1]:
                    shutil.rmtree(dst, ignore_errors=True)
                    subprocess.run(["sync"], check=True)
                    t0 = time.perf_counter()
                    done = subprocess.run([*cmd, *extra], check=True, capture_output=True, text=True)
                    peak = int(done.stderr.split()[-1]) << 10
                    rows.setdefault(name, []).append({"time": time.perf_counter() - t0, "peak": peak})
                if args.reshard_only:
                    continue
                anchor = _load(src, n, layout, mesh, save=str(ref))
                rows.setdefault("torch load+save", []).append(
                    {"time": anchor["load"] + anchor["save"], "wall": anchor["wall"]}
                )
                rows.setdefault("load original", []).append(_load(src, n, layout, mesh))
                rows.setdefault("load resharded", []).append(_load(dst, n, layout, mesh))
            print(f"\n{args.source_ranks} -> {n} ranks, {layout}{' on ' + mesh_text if mesh_text else ''}:")
            for name, got in rows.items():
                seconds = statistics.median(r.get("time", r.get("load", 0.0)) for r in got)
                last = got[-1]
                more = (
                    f"  whole launch {statistics.median(r['wall'] for r in got):.2f} s"
                    if "wall" in last and "load" not in last
                    else ""
                )
                more += f"  peak RSS {max(r['peak'] for r in got) / 2**20:.0f} MiB" if "peak" in last else ""
                more += (
                    f"  data files opened per rank {last['files']} (opens {last['opens']})" if "files" in last else ""
                )
                print(f"  {name:<16} {seconds:7.2f} s{more}")
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
