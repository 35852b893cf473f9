"""``dcpstudio check`` and ``dcpstudio hash`` side by side with ``cat`` and ``sha256sum`` of the
same files, in one run: whole commands, start-up included, warm page cache (every file read once
before the first measurement), the median of ``--rounds``. Peak RSS is each child's own
(``ru_maxrss`` from ``wait4``), so the interpreter and its imports count; Linux folds into it the
pages of the forked bench before ``exec`` (about 14 MiB), a floor that only small tools show.

Targets (issue 29): ``check`` <= 1.2x ``cat``, ``hash`` <= 1.2x ``sha256sum``, peak RSS <= 300 MiB;
``verify`` of a bitwise-equal pair (a DCP and its safetensors conversion, ``--verify-size`` each,
0.5 GiB by default) <= 2x ``cat A B`` + 0.3 s.
``check --values`` reads every tensor too; it is shown against ``cat`` with no target of its own.
The checkpoint: 16 fp32 tensors of ``--size`` in all (2 GiB by default), written by DCP Studio in
``--format`` (a DCP over 4 files by default). The machine's load average is printed before and
after: on a shared machine a figure is only as good as the load beside it.

    python tests/perf/bench_check.py [--size 2GiB] [--format dcp|safetensors|torch] [--rounds 3]
        [--verify-size 512MiB]
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

MAKE = r"""
import sys, torch
from dcpstudio.core import convert
from dcpstudio.core.ops.convert.convert import parse_size
size, fmt, work = parse_size(sys.argv[1]), sys.argv[2], sys.argv[3]
cols = 4096
rows = max(1, size // 16 // 4 // cols)
g = torch.Generator().manual_seed(0)
sd = {f"layers.{i}.w": torch.randn(rows, cols, generator=g) for i in range(16)}
torch.save(sd, f"{work}/m.pt")
del sd
if fmt == "dcp":
    convert(f"{work}/m.pt", f"{work}/m_dcp", to="dcp", files=4)
elif fmt == "safetensors":
    convert(f"{work}/m.pt", f"{work}/m.safetensors", to="safetensors")
"""

MAKE_PAIR = r"""
import sys, torch
from dcpstudio.core import convert
from dcpstudio.core.ops.convert.convert import parse_size
size, work = parse_size(sys.argv[1]), sys.argv[2]
cols = 4096
rows = max(1, size // 16 // 4 // cols)
g = torch.Generator().manual_seed(1)
torch.save({f"layers.{i}.w": torch.randn(rows, cols, generator=g) for i in range(16)}, f"{work}/v.pt")
convert(f"{work}/v.pt", f"{work}/va_dcp", to="dcp", files=4)
convert(f"{work}/va_dcp", f"{work}/vb.safetensors", to="safetensors")
"""

TARGET = {"check": 1.2, "hash": 1.2}
PYCACHE = Path(tempfile.gettempdir()) / "dcpstudio-bench-pycache"


def _env() -> dict[str, str]:
    """Bytecode cached (in PYCACHE), as after a pip install, even where ``PYTHONDONTWRITEBYTECODE``
    is set -- else every command would compile every module it imports (~0.1-0.2 s here)."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


RSS_LIMIT = 300 << 20


def _run(cmd: list[str]) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in bytes and exit status of one whole command (stdout discarded)."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.stderr is not None
    err = child.stderr.read().decode(errors="replace").strip()
    child.stderr.close()
    if child.returncode not in (0,):
        raise SystemExit(f"{' '.join(cmd[:3])}… exited {child.returncode}: {err.splitlines()[-1:] or ''}")
    return wall, usage.ru_maxrss << 10, child.returncode


def _median(cmd: list[str], rounds: int) -> tuple[float, int]:
    _run(cmd)  # unmeasured: its modules' bytecode cached, the files in the page cache
    runs = [_run(cmd) for _ in range(rounds)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="tensor bytes in all (default 2GiB)")
    ap.add_argument("--format", default="dcp", choices=("dcp", "safetensors", "torch"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verify-size", default="512MiB", help="tensor bytes of each side of the verify pair")
    args = ap.parse_args()
    dcpstudio = shutil.which("dcpstudio", path=str(Path(sys.executable).parent)) or shutil.which("dcpstudio")
    if dcpstudio is None:
        raise SystemExit("dcpstudio is not installed in this environment: pip install -e .")

    with tempfile.TemporaryDirectory(prefix="dcpstudio-check-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-c", MAKE, args.size, args.format, tmp], check=True)
        ckpt = {"dcp": work / "m_dcp", "safetensors": work / "m.safetensors", "torch": work / "m.pt"}[args.format]
        if args.format != "torch":
            (work / "m.pt").unlink()
        files = [str(p) for p in sorted(ckpt.rglob("*"))] if ckpt.is_dir() else [str(ckpt)]
        files = [f for f in files if Path(f).is_file()]
        size = sum(Path(f).stat().st_size for f in files)
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        print(
            f"{args.format} checkpoint, {len(files)} files, {size / 2**30:.2f} GiB; whole commands, median of "
            f"{args.rounds}, warm cache; load average {_load()} ({os.cpu_count()} CPUs)"
        )
        rows = [
            ("cat FILES > /dev/null", "cat", ["cat", *files]),
            ("sha256sum FILES", "sha256sum", ["sha256sum", *files]),
            ("dcpstudio check -q CKPT", "check", [dcpstudio, "check", "-q", str(ckpt)]),
            ("dcpstudio hash -q CKPT", "hash", [dcpstudio, "hash", "-q", str(ckpt)]),
            ("dcpstudio check --values -q CKPT", "values", [dcpstudio, "check", "--values", "-q", str(ckpt)]),
        ]
        walls: dict[str, float] = {}
        for label, key, cmd in rows:
            wall, rss = _median(cmd, args.rounds)
            walls[key] = wall
            anchor = {"check": "cat", "values": "cat", "hash": "sha256sum"}.get(key)
            line = f"  {label:34} {wall:7.3f} s  {size / 2**20 / wall:8.0f} MiB/s  peak RSS {rss / 2**20:6.1f} MiB"
            if anchor is not None:
                ratio = wall / walls[anchor]
                verdict = ""
                if key in TARGET:
                    ok = ratio <= TARGET[key] and rss <= RSS_LIMIT
                    verdict = f"  target <= {TARGET[key]}x and <= 300 MiB: {'met' if ok else 'NOT met'}"
                line += f"  {ratio:5.2f}x {anchor}{verdict}"
            print(line, flush=True)
        _without_manifest(dcpstudio, ckpt, walls["cat"], args.rounds)
        _verify_rows(dcpstudio, work, args)
        print(f"load average after: {_load()}")
    return 0


def _without_manifest(dcpstudio: str, ckpt: Path, cat: float, rounds: int) -> None:
    """``check`` with the checkpoint's manifest set aside: what it costs without re-hashing every
    file's SHA-256 against the manifest (a DCP Studio output carries one)."""
    from dcpstudio.core.formats.manifest import MANIFEST_FILE

    manifest = ckpt / MANIFEST_FILE if ckpt.is_dir() else None
    if manifest is None or not manifest.is_file():
        return
    aside = manifest.with_name(manifest.name + ".aside")
    manifest.rename(aside)
    try:
        wall, rss = _median([dcpstudio, "check", "-q", str(ckpt)], rounds)
    finally:
        aside.rename(manifest)
    label = "dcpstudio check -q (no manifest)"
    print(f"  {label:34} {wall:7.3f} s  peak RSS {rss / 2**20:6.1f} MiB  {wall / cat:5.2f}x cat", flush=True)


def _verify_rows(dcpstudio: str, work: Path, args: argparse.Namespace) -> None:
    """``verify`` of a bitwise-equal pair against ``cat A B``: target <= 2x + 0.3 s."""
    subprocess.run([sys.executable, "-c", MAKE_PAIR, args.verify_size, str(work)], check=True)
    (work / "v.pt").unlink()
    a, b = work / "va_dcp", work / "vb.safetensors"
    files = [str(p) for p in sorted(a.iterdir()) if p.is_file()] + [str(b)]
    size = sum(Path(f).stat().st_size for f in files)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    print(f"verify pair: DCP + safetensors, {size / 2**30:.2f} GiB in all; load average {_load()}")
    cat, _ = _median(["cat", *files], args.rounds)
    wall, rss = _median([dcpstudio, "verify", "-q", str(a), str(b)], args.rounds)
    limit = 2 * cat + 0.3
    print(f"  {'cat A B > /dev/null':34} {cat:7.3f} s")
    print(
        f"  {'dcpstudio verify -q A B':34} {wall:7.3f} s  peak RSS {rss / 2**20:6.1f} MiB  {wall / cat:5.2f}x cat"
        f"  target <= 2x cat + 0.3 s = {limit:.3f} s: {'met' if wall <= limit else 'NOT met'}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
