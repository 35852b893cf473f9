"""Faults while writing: a full disk at every stage, SIGKILL mid-write, cancel at random points,
and multi-rank failures. The destination is absent or complete, an existing destination is
untouched, and temporaries are removed (after SIGKILL: by the next run)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dcpstudio.core import CancelledError, CancelToken, convert, open_checkpoint, torch_save_to_dcp
from tests.conftest import leftovers

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"to_dcp": ("pt", "dcp"), "to_torch": ("dcp", "torch"), "to_safetensors": ("dcp", "safetensors")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    work = tmp_path_factory.mktemp("faults")
    pt = work / "src.pt"
    torch.save(llama_like_state_dict(16 << 20), pt)
    torch_save_to_dcp(pt, work / "src_dcp")
    return {"pt": pt, "dcp": work / "src_dcp"}


def _worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.reliability.fault_worker", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _existing(tmp_path: Path, target: str) -> tuple[Path, dict[str, bytes]]:
    """A small checkpoint of the target's kind at ``tmp_path / "existing"`` (only those may be
    replaced), and its bytes, to check it survives."""
    tiny = tmp_path / "tiny.pt"
    torch.save({"precious": torch.arange(7)}, tiny)
    existing = tmp_path / "existing"
    convert(tiny, existing, to=target)  # type: ignore[arg-type]
    tiny.unlink()
    return existing, _snapshot(existing)


def _snapshot(path: Path) -> dict[str, bytes]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): p.read_bytes() for p in files}


def _complete(path: Path, target: str) -> bool:
    with open_checkpoint(path) as ckpt:
        return ckpt.format == target and len(ckpt.entries) > 100


@pytest.mark.parametrize("direction", list(TARGETS))
def test_disk_full_at_every_stage(sources: dict[str, Path], tmp_path: Path, direction: str) -> None:
    src_kind, target = TARGETS[direction]
    convert(sources[src_kind], tmp_path / "reference", to=target)  # type: ignore[arg-type]
    ref = tmp_path / "reference"
    largest = max(p.stat().st_size for p in ([ref] if ref.is_file() else ref.rglob("*")) if p.is_file())
    # the last point fails within the final 0.1% (output sizes vary slightly with the destination's name)
    limits = [0, 64, 4096, largest // 100, largest // 2, largest * 9 // 10, largest * 999 // 1000]
    existing, before = _existing(tmp_path, target)
    out = _worker("fsize", str(sources[src_kind]), target, str(tmp_path), *map(str, limits))
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(limits)
    for r in results:  # a write past the limit fails with EFBIG, as on a full disk
        assert r["outcome"] == "domain-error" and "File too large" in r["message"], r
        assert not (tmp_path / f"out_{r['limit']}").exists()
    assert _snapshot(existing) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("direction", list(TARGETS))
def test_sigkill_mid_write_then_the_next_run_cleans_up(
    sources: dict[str, Path], tmp_path: Path, direction: str
) -> None:
    src_kind, target = TARGETS[direction]
    rng = random.Random(direction)
    dst = tmp_path / "out"
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.fault_worker", "slow", str(sources[src_kind]), str(dst), target],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert not dst.exists() or _complete(dst, target), f"attempt {attempt}: a partial destination"
    convert(sources[src_kind], dst, to=target, overwrite=True)  # type: ignore[arg-type]
    assert _complete(dst, target) and leftovers(tmp_path) == []  # killed runs' temporaries are gone


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
@pytest.mark.parametrize("direction", list(TARGETS))
def test_cancel_at_random_points(sources: dict[str, Path], tmp_path: Path, direction: str) -> None:
    src_kind, target = TARGETS[direction]
    rng = random.Random(7)
    existing, before = _existing(tmp_path, target)
    for point in sorted(rng.sample(range(0, 110), 10)):
        token = CancelToken()
        calls = [0]

        def progress(p: object, token: CancelToken = token, point: int = point, calls: list[int] = calls) -> None:
            calls[0] += 1
            if calls[0] > point:
                token.cancel()

        for dst, overwrite in ((tmp_path / "out", False), (existing, True)):
            calls[0] = 0
            with pytest.raises(CancelledError):
                convert(sources[src_kind], dst, to=target, progress=progress, cancel=token, overwrite=overwrite)  # type: ignore[arg-type]
            assert leftovers(tmp_path) == []
        assert not (tmp_path / "out").exists() and _snapshot(existing) == before


def test_launcher_with_a_port_already_taken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import socket

    from dcpstudio.core.ranks import launch as launch_mod
    from tests import _ranks

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setattr(launch_mod, "free_port", lambda: busy.getsockname()[1])
    t0 = time.monotonic()
    try:
        with pytest.raises(launch_mod.LaunchError, match="rank"):
            launch_mod.launch(_ranks.raise_on_rank, ("unused",), nprocs=2, timeout=30)
    finally:
        busy.close()
    assert time.monotonic() - t0 < 35 and multiprocessing.active_children() == []
