"""Fault injection: each damage is found by ``check`` and named by file and entry."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.core.ops.integrity import CheckReport, check_path
from tests.conftest import dcp_save


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(40, 30, generator=g), "b": torch.randn(50, 20, generator=g),
            "c": torch.arange(12).reshape(3, 4), "step": 7}  # fmt: skip


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("check")
    torch.save(_state(), root / "m.pt")
    convert(root / "m.pt", root / "m.dcp", to="dcp", files=3)
    with pytest.warns(UserWarning, match="holds tensors only"):
        convert(root / "m.pt", root / "m.st", to="safetensors", max_shard_size=6000)
    return root


def _copy(sources: Path, name: str, tmp_path: Path) -> Path:
    src, dst = sources / name, tmp_path / name
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return dst


def _named(report: CheckReport, file: str, entry: str) -> str:
    assert not report.whole
    hits = [f.what for f in report.findings if f.file == file and f.entry.startswith(entry)]
    assert hits, report.text()
    return hits[0]


def _chunk(path: Path, fqn: str) -> tuple[str, int, int, int | None]:
    with open_checkpoint(path) as ckpt:
        (c,) = ckpt.resolve_chunks(fqn)
        assert c.file is not None and c.offset is not None and c.length is not None
        return c.file, c.offset, c.length, c.data_offset


def test_whole_checkpoints_are_whole(sources: Path) -> None:
    for name in ("m.pt", "m.dcp", "m.st"):
        report = check_path(sources / name, values=True)
        assert report.whole, report.text()
        assert report.values is not None and len(report.values) == 3


def test_a_truncated_distcp_names_the_file_and_entry(sources: Path, tmp_path: Path) -> None:
    dcp = _copy(sources, "m.dcp", tmp_path)
    file, offset, length, _ = _chunk(dcp, "b")
    with open(dcp / file, "r+b") as f:
        f.truncate(offset + length // 2)  # cut inside b's archive
    assert "past the end of the file" in _named(check_path(dcp), file, "b")


def test_a_chunk_past_its_file_end_and_a_tail(sources: Path, tmp_path: Path) -> None:
    dcp = _copy(sources, "m.dcp", tmp_path)
    file, offset, _, _ = _chunk(dcp, "b")
    with open(dcp / file, "r+b") as f:
        f.truncate(offset)  # b lies wholly past the end
    report = check_path(dcp)
    assert "past the end" in _named(report, file, "b")
    other, _, _, _ = _chunk(dcp, "a")
    with open(dcp / other, "ab") as f:
        f.write(b"left over")
    assert "unexplained tail" in _named(check_path(dcp), other, "")


def test_a_flipped_byte_making_a_nan_is_found_with_values(sources: Path, tmp_path: Path) -> None:
    dcp = _copy(sources, "m.dcp", tmp_path)
    (dcp / "dcpstudio-manifest.json").unlink()  # what the structure alone tells (a manifest finds any flip)
    file, _, _, data = _chunk(dcp, "a")
    assert data is not None
    with open(dcp / file, "r+b") as f:
        f.seek(data + 4 * 17)
        f.write(struct.pack("<f", float("nan")))  # one element's bytes on a bad disk
    assert check_path(dcp).whole  # structure intact
    report = check_path(dcp, values=True)
    assert _named(report, file, "a") == "1 NaN values"


def test_a_missing_safetensors_shard_is_named(sources: Path, tmp_path: Path) -> None:
    st = _copy(sources, "m.st", tmp_path)
    shards = sorted(st.glob("*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with open(shards[0], "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)  # and another cut short: both named, not the first alone
    report = check_path(st)
    assert "missing" in _named(report, shards[1].name, "")
    assert "truncated" in _named(report, shards[0].name, "")
    assert all(f.entry for f in report.findings)  # the tensors the index maps to each shard


def test_a_zstd_frame_cut_short_is_named(tmp_path: Path) -> None:
    zstd = pytest.importorskip("torch.distributed.checkpoint._extension")
    from torch.distributed.checkpoint import FileSystemWriter

    path = tmp_path / "z"
    sd = {"model": {"w": torch.arange(4000.0).reshape(40, 100), "b": torch.ones(5)}, "step": 4}
    dcp_save(sd, storage_writer=FileSystemWriter(path, _extensions=[zstd.ZStandard()]))
    assert check_path(path).whole
    with open_checkpoint(path) as ckpt:
        (c,) = ckpt.chunks("model.w")
    assert c.file is not None and c.offset is not None and c.length is not None
    with open(path / c.file, "r+b") as f:
        f.seek(c.offset + c.length // 2)
        f.write(bytes(c.length - c.length // 2))  # the frame's second half gone, the item's size kept
    report = check_path(path)
    assert _named(report, c.file, "model.w")
    assert [f.entry for f in report.findings] == ["model.w"]


def test_a_checkpoint_of_more_files_than_descriptors(tmp_path: Path) -> None:
    """A DCP of 300 data files (as 300 ranks save it) checked under a soft limit of descriptors
    below that: the limit is raised toward the hard one and the check passes; with the hard limit
    as low too (in a child: a lowered hard limit cannot be raised back), one line saying so."""
    import os
    import resource
    import subprocess
    import sys

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    pt = tmp_path / "m.pt"
    torch.save({"w": torch.randn(300, 2)}, pt)
    convert(pt, tmp_path / "r", for_ranks=300, manifest=False)
    assert len(list((tmp_path / "r").glob("*.distcp"))) == 300
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"a hard limit of {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 100, hard))
    try:
        report = check_path(tmp_path / "r")
        assert report.whole and report.files == 300, report.text()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > len(os.listdir("/proc/self/fd")) + 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    child = (
        "import resource, sys; from dcpstudio.cli.main import main; resource.setrlimit(resource.RLIMIT_NOFILE, "
        "(120, 120)); sys.exit(main(['check', sys.argv[1]]))"
    )
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path / "r")], capture_output=True, text=True)
    assert done.returncode == 1, done  # an error, as for any checkpoint that does not open
    assert "ulimit -n" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
