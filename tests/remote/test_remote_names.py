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

from dcpstudio.core import CorruptCheckpointError, convert, open_checkpoint
from dcpstudio.core._files import member_path
from dcpstudio.core._remote import RemotePath


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
