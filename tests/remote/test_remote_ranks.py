"""Distributed conversion and remote stores: each rank reads its own ranges of a remote source; into
S3, each rank uploads its parts of each object's multipart upload -- the bytes one process uploads,
and nothing left (no object, no pending upload) when a rank fails. Other stores are refused, naming why.

The outputs are compared with the same destination URL (a DCP's ``checkpoint_id`` is the destination
as given): the single-process output is read and removed, then the ranks write theirs there."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert
from dcpstudio.core.ranks.convert import KILL_VARIABLE, run_convert
from dcpstudio.core.ranks.launch import LaunchError

# (name, options, ranks): every target; a cast that cuts parts inside bf16 elements; ZIP records whose
# CRC fields sit in parts uploaded after the CRC exchange; shards and DCP files as several uploads
CASES: list[tuple[str, dict[str, Any]]] = [
    ("out.safetensors", {"to": "safetensors", "dtype": "bf16"}),
    ("shards", {"to": "safetensors", "max_shard_size": 7 << 20}),
    ("out.pt", {"to": "torch"}),
    ("out_dcp", {"to": "dcp", "files": 2, "dtype": "fp16"}),  # its manifest: the ranks read the files back
]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~13 MiB of tensors (parts of 5 MiB: both ranks upload some), one of them 7 MiB, a view."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "big": torch.randn(1792, 1024, generator=g),  # 7 MiB
        "layers": {str(i): torch.randn(300, 700 + i, generator=g) for i in range(6)},
        "view": torch.randn(60, 70, generator=g).t(),
        "ids": torch.arange(3000, dtype=torch.int64),
    }
    path = tmp_path_factory.mktemp("src") / "src.pt"
    torch.save(sd, path)
    return path


def _objects(s3: Any, url: str) -> dict[str, bytes]:
    root = url.removeprefix("s3://")
    if s3.isfile(root):
        return {"": s3.cat_file(root)}
    return {name[len(root) :]: s3.cat_file(name) for name in s3.find(root)}


def _pending(s3_client: Any, bucket: str) -> list[Any]:
    return list(s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_ranks_upload_the_single_process_bytes_to_s3(
    source: Path, bucket: str, s3: Any, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "s3")
    warnings.simplefilter("ignore")
    s3.pipe_file(f"{bucket}/src/src.pt", source.read_bytes())
    for name, options in CASES:
        src = f"s3://{bucket}/src/src.pt" if name == "out_dcp" else source  # S3 to S3: each rank reads its ranges
        url = f"s3://{bucket}/{name}"
        convert(src, url, **options)
        one = _objects(s3, url)
        s3.rm(url.removeprefix("s3://"), recursive=True)
        s3.invalidate_cache()
        _, shares = run_convert(src, url, ranks=2, timeout=120, **options)
        assert all(s.nbytes and s.pieces for s in shares), (name, shares)  # both ranks uploaded parts
        s3.invalidate_cache()
        many = _objects(s3, url)
        assert sorted(many) == sorted(one) and ("/dcpstudio-manifest.json" in one) == (name == "out_dcp"), name
        assert all(many[k] == one[k] for k in one), name
        assert _pending(s3_client, bucket) == []
    assert s3_client.list_objects_v2(Bucket=bucket)["KeyCount"] == 1 + sum(
        len(_objects(s3, f"s3://{bucket}/{n}")) for n, _ in CASES
    )
    got = torch.load(__import__("io").BytesIO(s3.cat_file(f"{bucket}/out.pt")), weights_only=True)
    assert torch.equal(got["big"], torch.load(source)["big"])


def test_a_rank_failing_midway_leaves_nothing_in_s3(
    source: Path, bucket: str, s3: Any, s3_client: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank killed after its first part (the other aborts every upload), and a rank whose upload
    fails (an error; every rank aborts): no object, no pending upload; a replaced checkpoint stays."""
    warnings.simplefilter("ignore")
    url = f"s3://{bucket}/shards"
    for killed in (1, 0):  # rank 0 started the uploads; killed, rank 1 aborts them
        monkeypatch.setenv(KILL_VARIABLE, str(killed))
        with pytest.raises(LaunchError, match=f"rank {killed} was killed"):
            run_convert(source, url, ranks=2, timeout=120, **CASES[1][1])
        s3.invalidate_cache()
        assert not s3.exists(url.removeprefix("s3://")) and _pending(s3_client, bucket) == []
    monkeypatch.delenv(KILL_VARIABLE)

    s3.pipe_file(f"{bucket}/out.pt", source.read_bytes())  # replaced with --overwrite, or kept
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3_server.fail_upload_part(1, times=None)
    with pytest.raises(LaunchError, match="cannot write"):
        run_convert(source, f"s3://{bucket}/out.pt", ranks=2, timeout=120, overwrite=True, to="torch")
    s3.invalidate_cache()
    assert s3.cat_file(f"{bucket}/out.pt") == source.read_bytes()
    assert s3_client.list_objects_v2(Bucket=bucket)["KeyCount"] == 1 and _pending(s3_client, bucket) == []


def test_ranks_read_a_remote_source_and_refuse_stores_without_parts(
    http_root: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "remote")
    warnings.simplefilter("ignore")
    torch.save({"w": torch.randn(500, 300), "n": {"b": torch.randn(40)}}, tmp_path / "src.pt")
    shutil.copy(tmp_path / "src.pt", http_root.root / "src.pt")
    url = f"{http_root.url}/src.pt"
    for folder in ("one", "many"):
        (tmp_path / folder).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    convert(url, "out_dcp", to="dcp", dtype="bf16", manifest=False)
    monkeypatch.chdir(tmp_path / "many")
    _, shares = run_convert(url, "out_dcp", ranks=2, timeout=120, to="dcp", dtype="bf16", manifest=False)
    assert all(s.nbytes for s in shares)
    for f in (tmp_path / "one" / "out_dcp").iterdir():
        assert f.read_bytes() == (tmp_path / "many" / "out_dcp" / f.name).read_bytes(), f.name
    with pytest.raises(Exception, match=r"only S3 takes here \(http stores take no parts"):
        run_convert(tmp_path / "src.pt", f"{http_root.url}/out_dcp", ranks=2, to="dcp", manifest=False)
