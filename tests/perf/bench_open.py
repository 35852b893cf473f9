"""How fast a checkpoint opens: a DCP whose .metadata lists 100,000 tensors (4 chunks each) and a
2 GiB torch.save file, each open timed in a fresh process, side by side with torch's own readers.

    python tests/perf/bench_open.py [--tensors 100000] [--size 2GiB] [--repeat 3]
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
import torch, torch.distributed.checkpoint  # imported before timing, as in a running app
from dcpstudio.core import open_checkpoint
t0 = time.perf_counter()
extra = {}
if mode == "ours":
    ckpt = open_checkpoint(path)
    extra["entries"] = len(ckpt.entries)
elif mode == "ours+storage":
    ckpt = open_checkpoint(path)
    first = next(iter(ckpt.entries))
    ckpt.chunks(first)
elif mode == "torch-read_metadata":
    from torch.distributed.checkpoint import FileSystemReader
    FileSystemReader(path).read_metadata()
elif mode == "torch.load-mmap":
    torch.load(path, mmap=True, weights_only=True)
elif mode == "torch.load":
    torch.load(path, weights_only=True)
print(json.dumps({"wall": time.perf_counter() - t0, **extra}))
"""


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def make_big_metadata(directory: Path, tensors: int, chunks: int = 4) -> None:
    """A .metadata as torch's FileSystemWriter would write it for ``tensors`` sharded tensors."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm = {}
    storage = {}
    rows = 16
    for i in range(tensors):
        fqn = f"model.layers.{i // 10}.block.{i % 10}.weight"
        parts = [ChunkStorageMetadata(torch.Size([r * rows, 0]), torch.Size([rows, 64])) for r in range(chunks)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([rows * chunks, 64]), parts)
        for r, c in enumerate(parts):
            storage[MetadataIndex(fqn, c.offsets)] = _StorageInfo(f"__{r}_0.distcp", i * 2600, 2600)
    md = Metadata(state_dict_metadata=sdm, planner_data={k: tuple(k.split(".", 1)) for k in sdm}, storage_data=storage)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(md, f)


def timed(mode: str, path: Path, repeat: int) -> tuple[float, dict]:
    walls, last = [], {}
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", RUNNER, mode, str(path)], check=True, capture_output=True, text=True
        )
        last = json.loads(out.stdout.strip().splitlines()[-1])
        walls.append(last["wall"])
    return statistics.median(walls), last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import torch

    from dcpstudio.core.demo import llama_like_state_dict

    with tempfile.TemporaryDirectory(prefix="dcpstudio-open-") as tmp:
        work = Path(tmp)
        make_big_metadata(work / "big_dcp", args.tensors)
        md_size = (work / "big_dcp" / ".metadata").stat().st_size
        torch.save(llama_like_state_dict(_parse_size(args.size)), work / "big.pt")
        pt_size = (work / "big.pt").stat().st_size

        groups = [
            (
                f"DCP .metadata: {args.tensors} tensors x 4 chunks, {md_size / 2**20:.0f} MiB",
                work / "big_dcp",
                [
                    ("dcpstudio open_checkpoint (target <= 1 s)", "ours"),
                    ("dcpstudio open + first storage lookup", "ours+storage"),
                    ("torch FileSystemReader.read_metadata", "torch-read_metadata"),
                ],
            ),
            (
                f"torch.save file: {pt_size / 2**30:.2f} GiB",
                work / "big.pt",
                [
                    ("dcpstudio open_checkpoint (target <= 0.3 s)", "ours"),
                    ("torch.load(mmap=True, weights_only=True)", "torch.load-mmap"),
                    ("torch.load(weights_only=True)", "torch.load"),
                ],
            ),
        ]
        for title, path, rows in groups:
            print(title)
            for label, mode in rows:
                wall, extra = timed(mode, path, args.repeat)
                print(f"  {label:44} {wall:7.3f} s  {extra.get('entries', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
