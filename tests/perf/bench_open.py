"""How fast a checkpoint opens, side by side in one run: two generated DCP ``.metadata`` files --
100,000 tensors x 4 chunks, and a 1,024-rank FSDP run (20,000 tensors x 1,024 chunks) -- each
opened in a fresh process with an empty index cache (cold) and again with the cache it left
(re-open), next to torch's ``FileSystemReader.read_metadata``; then filtering the tree's names and
the GUI's heartbeat (a 10 ms timer on the GUI thread) while the window opens the checkpoint and
shows a tensor's chunks. Optionally a torch.save file as before (``--size``).

    QT_QPA_PLATFORM=offscreen python tests/perf/bench_open.py [--sets 100000x4,20000x1024]
        [--repeat 3] [--size 0|2GiB] [--keep DIR]

Targets: open <= 1 s; a tensor's chunk table <= 50 ms after open; re-open <= 0.2 s; filtering
100,000 names <= 100 ms; GUI heartbeat gap <= 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RUNNER = r"""
import json, os, random, resource, sys, time
mode, path = sys.argv[1:3]
import torch, torch.distributed.checkpoint  # imported before timing, as in a running app
from pathlib import Path
out = {}
def done():
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    sys.exit(0)
if mode == "open":
    from dcpstudio.core import open_checkpoint
    t0 = time.perf_counter()
    try:
        ckpt = open_checkpoint(Path(path))
    except Exception as e:
        out.update(error=f"{type(e).__name__}: {str(e)[-90:]}", open=time.perf_counter() - t0)
        done()
    t1 = time.perf_counter()
    names = list(ckpt.entries)
    ckpt.chunks(names[0])
    t2 = time.perf_counter()
    ckpt.chunks(random.Random(1).choice(names))
    t3 = time.perf_counter()
    ckpt.tree
    t4 = time.perf_counter()
    out.update(open=t1 - t0, first=t2 - t1, random=t3 - t2, tree=t4 - t3, entries=len(names))
elif mode == "torch":
    from torch.distributed.checkpoint import FileSystemReader
    t0 = time.perf_counter()
    FileSystemReader(path).read_metadata()
    out["open"] = time.perf_counter() - t0
elif mode == "filter":
    from dcpstudio.core import open_checkpoint
    from dcpstudio.window.tree_filter import EntryFilter, TreeIndex
    ckpt = open_checkpoint(Path(path))
    index = TreeIndex(ckpt.tree, ckpt.chunk_count)
    specs = (("text", EntryFilter(text="block.3")), ("regex", EntryFilter(text=r"layers\.1\d*\.", regex=True)),
             ("dtype+shape", EntryFilter(dtype="bfloat16", shape="*x64")))
    for name, spec in specs:
        t0 = time.perf_counter()
        found = index.select(spec)
        out[name] = time.perf_counter() - t0
        out[name + "_matches"] = len(found.matched)
elif mode == "gui":
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    from dcpstudio.window.main_window import MainWindow
    app = QApplication([])
    window = MainWindow()
    window.show()
    for _ in range(20):
        app.processEvents()
    gaps, last = [], [time.monotonic()]
    def beat():
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now
    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(beat)
    timer.start()
    t0 = time.monotonic()
    window.open_path(Path(path))
    while "open" not in window.jobs or window.jobs["open"].running:  # until it opens or fails
        app.processEvents()
        time.sleep(0.001)
        if time.monotonic() - t0 > 600:
            break
    for _ in range(5):
        app.processEvents()
    t1 = time.monotonic()
    open_gaps = gaps[1:]
    names = list(window.ckpt.entries) if window.ckpt is not None else []
    if names:
        window.select(random.Random(2).choice(names))
        app.processEvents()
    t2 = time.monotonic()
    for _ in range(10):
        app.processEvents()
        time.sleep(0.01)
    timer.stop()
    out.update(open=t1 - t0, select=t2 - t1, max_gap=max(open_gaps) if open_gaps else None, beats=len(open_gaps),
               select_gap=max(gaps[len(open_gaps):], default=None), opened=window.ckpt is not None)
    window.close()
elif mode in ("torch.load-mmap", "torch.load"):
    t0 = time.perf_counter()
    torch.load(path, mmap=mode.endswith("mmap"), weights_only=True)
    out["open"] = time.perf_counter() - t0
elif mode == "ours-file":
    from dcpstudio.core import open_checkpoint
    t0 = time.perf_counter()
    open_checkpoint(Path(path))
    out["open"] = time.perf_counter() - t0
done()
"""


def run(mode: str, path: Path, cache: Path) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, mode, str(path)], env=env, capture_output=True, text=True, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][-100:]}
    found: dict = json.loads(lines[-1])
    return found


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _s(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "      -"
    return f"{v * 1000:6.0f} ms" if unit == "ms" else f"{v:7.3f} s"


def bench_set(work: Path, tensors: int, ranks: int, repeat: int, keep: Path | None) -> None:
    from tests.perf import big_metadata

    folder = (keep or work) / f"dcp_{tensors}x{ranks}"
    md = folder / ".metadata"
    rows, cols = (16, 64) if ranks <= 4 else (4, 4096)
    if not md.exists():
        folder.mkdir(parents=True, exist_ok=True)
        big_metadata.write_metadata(md, tensors, ranks, rows=rows, cols=cols)
    size = md.stat().st_size
    print(
        f"\nDCP .metadata: {tensors:,} tensors x {ranks:,} chunks = {tensors * ranks:,} chunks, {size / 2**20:,.0f} MiB"
    )
    cold = []
    for k in range(repeat):
        cold.append(run("open", folder, work / f"cache-cold-{tensors}x{ranks}-{k}"))
    warm_dir = work / f"cache-cold-{tensors}x{ranks}-0"
    warm = [run("open", folder, warm_dir) for _ in range(repeat)]
    cache_files = list((warm_dir / "dcpstudio" / "index").glob("*.idx")) if warm_dir.exists() else []
    cache_size = sum(p.stat().st_size for p in cache_files)
    err = next((r["error"] for r in cold if "error" in r), None)
    print(f"  {'':44} {'open':>9} {'1st chunks':>10} {'random':>9} {'tree':>9} {'peak RSS':>9}")
    for label, rows_ in (("dcpstudio, cold (empty cache)", cold), ("dcpstudio, re-open (index cache)", warm)):
        print(
            f"  {label:44} {_s(median(rows_, 'open'))} {_s(median(rows_, 'first'), 'ms'):>10} "
            f"{_s(median(rows_, 'random'), 'ms'):>9} {_s(median(rows_, 'tree'))} "
            f"{median(rows_, 'rss_mib') or 0:7.0f} MiB"
        )
    if err:
        print(f"    cold open failed: {err}")
    print(f"    index cache: {cache_size / 2**20:.1f} MiB")
    if size <= 512 << 20:
        torch_rows = [run("torch", folder, work / "unused") for _ in range(max(1, repeat - 1))]
        print(
            f"  {'torch FileSystemReader.read_metadata':44} {_s(median(torch_rows, 'open'))} "
            f"{'':10} {'':9} {'':9} {median(torch_rows, 'rss_mib') or 0:7.0f} MiB"
        )
    else:
        print(
            f"  {'torch FileSystemReader.read_metadata':44} skipped: a {size / 2**30:.1f} GiB pickle of torch's classes"
        )
    if not err:
        f = run("filter", folder, warm_dir)
        print(
            f"  filter {tensors:,} names: text {_s(f.get('text'), 'ms')} ({f.get('text_matches')} matches), "
            f"regex {_s(f.get('regex'), 'ms')}, dtype+shape {_s(f.get('dtype+shape'), 'ms')}"
        )
    for label, cache in (("cold", work / f"cache-gui-{tensors}x{ranks}"), ("re-open", warm_dir)):
        g = run("gui", folder, cache)
        if "error" in g or not g.get("opened"):
            why = g.get("error", "not opened")
            print(f"  window open ({label}): {why}; max heartbeat gap {_s(g.get('max_gap'), 'ms')}")
            continue
        print(
            f"  window open ({label:7}): {_s(g.get('open'))} to the tree, max GUI heartbeat gap "
            f"{_s(g.get('max_gap'), 'ms')} over {g.get('beats')} beats; then selecting a tensor "
            f"{_s(g.get('select'), 'ms')} (gap {_s(g.get('select_gap'), 'ms')})"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="100000x4,20000x1024", help="TENSORSxCHUNKS,...")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--size", default="0", help="also a torch.save file of this size (e.g. 2GiB)")
    ap.add_argument("--keep", type=Path, help="keep the generated .metadata files here (reused when present)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="dcpstudio-open-") as tmp:
        work = Path(tmp)
        for spec in args.sets.split(","):
            tensors, ranks = (int(x) for x in spec.lower().split("x"))
            bench_set(work, tensors, ranks, args.repeat, args.keep)
        if args.size not in ("0", ""):
            _bench_torch_save(work, args.size, args.repeat)
    return 0


def _bench_torch_save(work: Path, size: str, repeat: int) -> None:
    import torch

    from dcpstudio.core.ops.convert.convert import parse_size
    from dcpstudio.core.ops.demo import llama_like_state_dict

    torch.save(llama_like_state_dict(parse_size(size)), work / "big.pt")
    print(f"\ntorch.save file: {(work / 'big.pt').stat().st_size / 2**30:.2f} GiB")
    for label, mode in (
        ("dcpstudio open_checkpoint (target <= 0.3 s)", "ours-file"),
        ("torch.load(mmap=True, weights_only=True)", "torch.load-mmap"),
        ("torch.load(weights_only=True)", "torch.load"),
    ):
        rows = [run(mode, work / "big.pt", work / "cache-pt") for _ in range(repeat)]
        print(f"  {label:44} {_s(median(rows, 'open'))}")


if __name__ == "__main__":
    raise SystemExit(main())
