"""The persistent index cache serves remote checkpoints too: a large remote ``.metadata`` is parsed
once; opening the unchanged checkpoint again asks the store for the object's identity (size,
modification time, ETag) and fetches nothing, and a changed object is parsed again."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpstudio.core import open_checkpoint
from tests.perf.big_metadata import write_metadata
from tests.remote.servers import S3Server


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _chunk_table(url: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    with open_checkpoint(url, full_index=True) as ckpt:
        fqn = next(e.fqn for e in ckpt.entries.values() if e.kind == "tensor")
        return [(tuple(c.offsets), tuple(c.sizes)) for c in ckpt.chunks(fqn)]


def test_a_large_remote_metadata_is_parsed_once(
    s3_server: S3Server, bucket: str, cache_home: Path, tmp_path: Path
) -> None:
    import s3fs

    md = tmp_path / ".metadata"
    write_metadata(md, 8000, 4)  # about 6 MiB: above the size whose index is cached
    assert md.stat().st_size > 4 << 20
    fs = s3fs.S3FileSystem()
    fs.put(str(md), f"{bucket}/ckpt/.metadata")
    url = f"s3://{bucket}/ckpt"

    s3_server.reset()
    first = _chunk_table(url)
    assert s3_server.bytes_sent(f"{bucket}/ckpt/.metadata") >= md.stat().st_size
    assert len(first) == 4 and list((cache_home / "dcpstudio" / "index").glob("*.idx"))

    s3_server.reset()
    again = _chunk_table(url)
    assert again == first
    assert s3_server.gets(f"{bucket}/ckpt/.metadata") == [], "the unchanged .metadata was fetched again"

    write_metadata(md, 8001, 4)  # the object changes: its ETag and size with it
    fs.put(str(md), f"{bucket}/ckpt/.metadata")
    s3fs.S3FileSystem.clear_instance_cache()
    from dcpstudio.core.io.remote.locations import RemotePath

    RemotePath(f"{url}/.metadata").forget()  # what this process knew of the object (a few seconds' memo)
    s3_server.reset()
    with open_checkpoint(url, full_index=True) as ckpt:
        assert len([e for e in ckpt.entries.values() if e.kind == "tensor"]) == 8001
    assert s3_server.bytes_sent(f"{bucket}/ckpt/.metadata") >= md.stat().st_size
