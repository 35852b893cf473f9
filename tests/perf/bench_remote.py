"""Remote checkpoints, side by side: DCP Studio reading from a local S3 server vs the backend's own
``get`` of the same bytes, plus what inspecting and reading one tensor fetch.

Starts moto's S3 server on 127.0.0.1 (the server s3fs's own tests use), uploads a synthetic
llama-like checkpoint of ``--size`` bytes as a torch.save file and as a DCP directory, then,
alternating the contenders round by round in one process (imports and the S3 session warmed up
first, as in a long-lived app):

* ``s3fs get``: ``fs.get`` of the object(s) to local disk, then ``sync`` -- the yardstick;
* ``convert`` remote torch.save -> local DCP, remote DCP -> local torch.save and local
  safetensors, each followed by ``sync`` (ours fsync as they write).

Then, for the 1 GiB torch.save and the DCP: requests and bytes fetched to open (inspect) it, and
to read one tensor. Prints a table with ratios.

    python tests/perf/bench_remote.py --size 1GiB --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = _size(args.size)

    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    import boto3
    import s3fs
    import torch

    from dcpstudio.core import convert, open_checkpoint
    from dcpstudio.core.io.remote.locations import fetch_stats
    from dcpstudio.core.ops.demo import llama_like_state_dict

    warnings.simplefilter("ignore")
    boto3.client("s3").create_bucket(Bucket="bench")
    fs = s3fs.S3FileSystem()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        sd = llama_like_state_dict(size)
        torch.save(sd, work / "src.pt")
        convert(work / "src.pt", work / "src_dcp", to="dcp")
        del sd
        with open_checkpoint(work / "src.pt") as local:
            name = max((e for e in local.entries.values() if e.kind == "tensor"), key=lambda e: e.nbytes).fqn
        fs.put(str(work / "src.pt"), "bench/ckpt.pt")
        fs.put(str(work / "src_dcp"), "bench/ckpt_dcp", recursive=True)
        nbytes = (work / "src.pt").stat().st_size
        print(f"checkpoint: {nbytes / 2**30:.2f} GiB torch.save and its DCP copy on s3://bench (moto, 127.0.0.1)")

        out = work / "out"

        def fresh() -> None:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()

        def synced(fn) -> float:  # type: ignore[no-untyped-def]
            fresh()
            t0 = time.perf_counter()
            fn()
            os.sync()
            return time.perf_counter() - t0

        contenders = {
            "s3fs get (pt)": lambda: fs.get("bench/ckpt.pt", str(out / "x.pt")),
            "s3fs get (dcp)": lambda: fs.get("bench/ckpt_dcp", str(out / "x_dcp"), recursive=True),
            "convert s3 pt -> local dcp": lambda: convert("s3://bench/ckpt.pt", out / "x_dcp", to="dcp"),
            "convert s3 dcp -> local pt": lambda: convert("s3://bench/ckpt_dcp", out / "x.pt", to="torch"),
            "convert s3 dcp -> local safetensors": lambda: convert(
                "s3://bench/ckpt_dcp", out / "x.safetensors", to="safetensors"
            ),
        }
        synced(contenders["s3fs get (pt)"])  # warm the session and the server
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(args.rounds):
            for label, fn in contenders.items():
                times[label].append(synced(fn))
        base = statistics.median(times["s3fs get (pt)"])
        base_dcp = statistics.median(times["s3fs get (dcp)"])
        print(f"\nmedian of {args.rounds} rounds (wall, sync included)")
        print(f"{'':40s}{'time':>9s}{'MB/s':>9s}{'vs get':>9s}")
        for label, ts in times.items():
            m = statistics.median(ts)
            yard = base_dcp if "dcp ->" in label or "(dcp)" in label else base
            print(f"{label:40s}{m:8.2f}s{nbytes / m / 1e6:9.0f}{m / yard:8.2f}x")

        print("\nfetched (requests, bytes)")
        for url in ("s3://bench/ckpt.pt", "s3://bench/ckpt_dcp"):
            s0 = fetch_stats()
            with open_checkpoint(url) as ckpt:
                s1 = fetch_stats()
                ckpt.read_tensor(name)
                s2 = fetch_stats()
                tensor_bytes = ckpt.entry(name).nbytes
            print(
                f"  {url}: open {s1.requests - s0.requests} requests, {s1.bytes - s0.bytes:,} B; "
                f"read {name} ({tensor_bytes:,} B): {s2.requests - s1.requests} requests, {s2.bytes - s1.bytes:,} B"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
