"""A remote checkpoint names its own files too; a hostile name must not reach outside its prefix.

Over HTTP a name such as ``%2e%2e/x`` is decoded by the server into ``../x``, and ``a?b`` or
``a#b`` address another resource: such names are refused, whatever the store. Runs on fsspec's
in-memory file system (the same byte-range layer as every store)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dcpstudio.core import CorruptCheckpointError, DCPStudioError, convert, open_checkpoint
from dcpstudio.core.io.files import member_path
from dcpstudio.core.io.remote.locations import RemotePath


@pytest.mark.parametrize("name", ["%2e%2e/x.distcp", "a?b.distcp", "a#b.distcp", "a//b.distcp", "a\\b.distcp", "../x"])
def test_names_that_would_leave_a_remote_prefix_are_refused(name: str) -> None:
    with pytest.raises(CorruptCheckpointError, match="refusing"):
        member_path(RemotePath("https://example.invalid/ckpt"), name, "DCP data file")


def test_plain_names_stay_under_the_prefix() -> None:
    root = RemotePath("s3://bucket/run/ckpt")
    assert str(member_path(root, "__0_0.distcp", "DCP data file")) == "s3://bucket/run/ckpt/__0_0.distcp"
    assert str(member_path(root, "shards/__1_0.distcp", "DCP data file")) == "s3://bucket/run/ckpt/shards/__1_0.distcp"


def test_a_remote_dcp_naming_an_encoded_parent_is_refused(rich_pt: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/{uuid.uuid4().hex}"
    convert(rich_pt, f"memory:/{root}/good", to="dcp")
    md = fs.cat_file(f"{root}/good/.metadata")
    assert md.count(b"__0_0.distcp") >= 1
    fs.pipe(f"{root}/bad/.metadata", md.replace(b"__0_0.distcp", b"%2e%2e/distc"))  # same length: a valid pickle
    fs.pipe(f"{root}/bad/__0_0.distcp", fs.cat_file(f"{root}/good/__0_0.distcp"))
    with open_checkpoint(f"memory:/{root}/bad") as ckpt:
        fqn = next(e.fqn for e in ckpt.entries.values() if e.kind == "tensor")
        with pytest.raises(CorruptCheckpointError, match="not a plain relative name"):
            ckpt.read_tensor(fqn)


def test_the_cli_reports_a_missing_backend_in_one_line() -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    r = subprocess.run(
        [sys.executable, "-m", "dcpstudio", "inspect", "gs://bucket/ckpt/"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "dcpstudio: error: gs://bucket/ckpt: gs:// addresses need the optional 'gcs' extra: "
        "pip install 'dcpstudio[gcs]'"
    ]


@pytest.mark.parametrize("name", [".\t./x.distcp", "a\r\n.distcp", " ../x", "x.distcp ", "a\x7fb"])
def test_names_with_control_characters_or_edge_spaces_are_refused(name: str) -> None:
    """yarl drops tabs and newlines from a URL and then resolves ``..``: ``.\\t./x`` would be ``../x``."""
    with pytest.raises(CorruptCheckpointError, match="refusing"):
        member_path(RemotePath("https://example.invalid/ckpt"), name, "DCP data file")


def test_a_bucket_itself_is_never_a_destination(rich_pt: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    bucket = uuid.uuid4().hex
    fs.pipe(f"/{bucket}/README.txt", b"someone else's")
    for overwrite in (False, True):
        with pytest.raises(DCPStudioError, match="a bucket itself; write under a prefix"):
            convert(rich_pt, f"memory://{bucket}", to="dcp", overwrite=overwrite)
    assert fs.cat_file(f"/{bucket}/README.txt") == b"someone else's"
    convert(rich_pt, f"memory://{bucket}/ckpt", to="dcp")
    assert fs.exists(f"/{bucket}/ckpt/.metadata") and fs.exists(f"/{bucket}/README.txt")


def test_streams_stay_few_whatever_the_number_of_files(tmp_path: Path) -> None:
    """Each stream may hold ~100 MiB: reading through a checkpoint of many large files keeps at most
    two alive, and closing it ends them."""
    import fsspec
    import torch

    from dcpstudio.core.io.remote import files as _remote_io

    torch.save({f"t{i}": torch.full((5 << 20,), float(i)) for i in range(4)}, tmp_path / "m.pt")  # 4 x 20 MiB
    root = f"/{uuid.uuid4().hex}"
    convert(tmp_path / "m.pt", f"memory:/{root}/ckpt", to="dcp", files=4)
    listed = {e["name"].rsplit("/", 1)[-1] for e in fsspec.filesystem("memory").ls(f"{root}/ckpt")}
    assert len({n for n in listed if n.endswith(".distcp")}) == 4 and ".metadata" in listed
    seen = []
    with open_checkpoint(f"memory:/{root}/ckpt") as ckpt:
        for i in range(4):
            assert float(ckpt.read_tensor(f"t{i}")[-1]) == i
            seen.append(len(_remote_io._live))
    assert max(seen) <= _remote_io.MAX_STREAMS and _remote_io._live == []
