"""``hash``, ``check --values`` and a bitwise ``verify`` read tensors' bytes in place without torch,
and say exactly what torch's path says: the same canonical bytes as torch's own readers (dcp.load,
torch.load), the same digests, NaN/Inf/zero counts and verdicts; torch is not imported on them."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.core.checkpoints.canonical import RawBuffers, canonical_source
from dcpstudio.core.ops.integrity import check, check_path, digests
from dcpstudio.core.ops.verify import verify
from tests import _ranks

digests_module = importlib.import_module("dcpstudio.core.ops.integrity.digests")
counts_module = importlib.import_module("dcpstudio.core.ops.integrity.counts")
verify_module = importlib.import_module("dcpstudio.core.ops.verify")


def _odd_values() -> dict[str, torch.Tensor]:
    """NaN, both infinities, zeros of both signs, in every dtype the bit tests handle."""
    base = torch.tensor([1.5, float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -2.0, 0.0])
    out = {f"odd.{dt}": base.to(getattr(torch, dt)) for dt in ("float32", "float64", "float16", "bfloat16")}
    out["odd.f8e5m2"] = base.to(torch.float8_e5m2)
    out["odd.f8e4m3"] = torch.tensor([1.0, float("nan"), 0.0, -0.0]).to(torch.float8_e4m3fn)
    out["odd.int"] = torch.tensor([[0, 3], [0, -1]], dtype=torch.int16)
    out["odd.bool"] = torch.tensor([True, False, False])
    out["odd.zero"] = torch.zeros(3, 5)
    out["odd.scalar"] = torch.tensor(2.5)
    out["odd.empty"] = torch.zeros(0, 4)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, multirank_dcp: Path) -> dict[str, Path]:
    """A 3-rank DCP (row and column shards, a replica, a rank holding nothing), torch.save views
    (transposed, strided, offset, two views of one storage), one and several safetensors files."""
    tmp = tmp_path_factory.mktemp("torch_free")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(30, 40, generator=g)
    views = {"t": base.t(), "s": base[5:9], "k": base.t()[2:30:3], "c": base[:, 7], **_odd_values()}
    torch.save(views, tmp / "views.pt")
    plain = {k: v.contiguous() for k, v in views.items()}
    save_file(plain, tmp / "one.safetensors")
    convert(tmp / "views.pt", tmp / "sharded_st", to="safetensors", max_shard_size=3000)
    convert(tmp / "views.pt", tmp / "views_dcp", to="dcp", files=3)
    return {"dcp": multirank_dcp, "pt": tmp / "views.pt", "st": tmp / "one.safetensors",
            "sharded": tmp / "sharded_st", "views_dcp": tmp / "views_dcp"}  # fmt: skip


def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reader below takes torch's path (what the fast path is compared with)."""
    for module in (digests_module, counts_module):
        monkeypatch.setattr(module, "canonical_source", lambda ckpt, fqn: None)


@pytest.mark.parametrize("kind", ["dcp", "pt", "st", "sharded", "views_dcp"])
def test_bytes_digests_and_counts_match_the_torch_path(files: dict[str, Path], kind: str, monkeypatch: Any) -> None:
    path = files[kind]
    with open_checkpoint(path) as ckpt:
        truth = _truth(path, ckpt)
        for fqn, want in truth.items():
            source = canonical_source(ckpt, fqn)
            assert source is not None, fqn  # every tensor here lies in place
            got = b"".join(bytes(b) for b in source.blocks(48, RawBuffers()))  # blocks across chunk borders
            assert got == want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), fqn
        fast_digests = [d.digest for d in digests(ckpt, budget=48)]
        fast_counts = check(ckpt, values=True)
    _torch_only(monkeypatch)
    with open_checkpoint(path) as ckpt:
        assert [d.digest for d in digests(ckpt, budget=48)] == fast_digests
        slow_counts = check(ckpt, values=True)
    assert fast_counts.values == slow_counts.values and fast_counts.findings == slow_counts.findings
    if kind == "pt":
        by_name = {v.fqn: v for v in fast_counts.values or ()}
        assert (by_name["odd.bfloat16"].nan, by_name["odd.bfloat16"].inf, by_name["odd.bfloat16"].zeros) == (1, 2, 3)
        assert (by_name["odd.f8e4m3"].nan, by_name["odd.f8e4m3"].zeros) == (1, 2)
        assert fast_counts.all_zero() == ["odd.zero"]


def _truth(path: Path, ckpt: Any) -> dict[str, torch.Tensor]:
    """Each tensor as torch's own reader gives it."""
    if path.is_dir() and (path / ".metadata").exists():
        target = {
            f: torch.empty(e.shape or (), dtype=e.dtype.torch) for f, e in ckpt.entries.items() if e.kind == "tensor"
        }
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
        return target
    if path.suffix == ".pt":
        return dict(torch.load(path, weights_only=True))
    return {f: ckpt.read_tensor(f) for f, e in ckpt.entries.items() if e.kind == "tensor"}


def test_verify_verdicts_match_the_full_comparison(files: dict[str, Path], tmp_path: Path, monkeypatch: Any) -> None:
    equal = verify(files["pt"], files["views_dcp"])
    assert equal.equal and equal.report.compared == len(_odd_values()) + 4
    changed = torch.load(files["pt"], weights_only=True)
    changed["s"] = changed["s"].clone()
    changed["s"][1, 2] += 1
    torch.save(changed, tmp_path / "changed.pt")
    differs = verify(files["pt"], tmp_path / "changed.pt")
    monkeypatch.setattr(verify_module, "bitwise_equal", lambda *a, **k: None)  # the full comparison alone
    assert verify(files["pt"], files["views_dcp"]).report == equal.report
    assert verify(files["pt"], tmp_path / "changed.pt").report == differs.report
    assert [v.fqn for v in differs.report.values] == ["s"]


def test_hash_check_values_and_equal_verify_do_not_import_torch(files: dict[str, Path], tmp_path: Path) -> None:
    paths = [str(files[k]) for k in ("dcp", "pt", "st", "sharded", "views_dcp")]
    script = textwrap.dedent(
        f"""
        import sys
        from dcpstudio.cli.main import main
        for path in {paths!r}:
            assert main(["hash", "-q", path]) == 0
            main(["check", "--values", "-q", path])
        assert main(["verify", "-q", {paths[1]!r}, {paths[4]!r}]) == 0
        assert main(["verify", "-q", {paths[2]!r}, {paths[3]!r}]) == 0
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NaN" in proc.stdout and "sha256-tree:" in proc.stdout


def test_a_diverged_replica_saved_by_two_ranks_is_named(tmp_path: Path) -> None:
    """Two gloo ranks save a replicated DTensor whose replicas differ, without torch's
    deduplication: the .metadata lists its region twice and keeps one record; dcp.load reads that
    one (rank 1's), rank 0's copy lies unread in its file. check names both, by file and entry."""
    path = tmp_path / "div"
    _ranks.save_divergent_replica(path)
    got = {"r": torch.zeros(4, 4), "w": torch.zeros(6, 4)}
    dcp.load(got, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(got["r"], torch.full((4, 4), 2.0))  # the ground truth: rank 1's copy is read
    report = check_path(path)
    assert not report.whole
    found = {(f.file, f.entry): f.what for f in report.findings}
    assert "listed 2 times" in found[("__1_0.distcp", "r")]
    assert "different values from the copy dcp.load reads (__1_0.distcp)" in found[("__0_0.distcp", "r")]
    assert len(report.findings) == 2  # w's shards are whole; no record is called unnamed wrongly


def test_check_without_values_reads_no_tensor_data(tmp_path: Path) -> None:
    """Only archives' directories are read (a torch-written DCP has no manifest to re-hash)."""
    dcp.save({"w": torch.randn(1024, 1024), "b": torch.zeros(7)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)

    def read_so_far() -> int:
        return int(Path("/proc/self/io").read_text().split("rchar: ")[1].split()[0])

    before = read_so_far()
    assert check_path(tmp_path / "d").whole
    assert read_so_far() - before < (4 << 20) // 8  # the 4 MiB tensor is not read
    before = read_so_far()
    assert check_path(tmp_path / "d", values=True).values is not None
    assert read_so_far() - before >= 4 << 20
