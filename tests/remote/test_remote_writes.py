"""Writing to S3 when things go wrong: an upload failing midway, a cancel during an upload, an
existing destination. Nothing incomplete is ever published: no object, no ``.metadata`` or index,
no leftovers under the destination or the temporary prefix, no multipart upload left open; an
existing checkpoint is replaced only with overwrite, and stays whole and readable when the
replacement fails."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import CancelledError, CancelToken, DCPStudioError, Progress, convert, open_checkpoint
from tests.conftest import assert_same
from tests.remote.conftest import one_line_error, run_cli
from tests.remote.servers import S3Server

MiB = 2**20
OLD = {"old.weight": torch.arange(12.0).reshape(3, 4), "old.bias": torch.arange(4, dtype=torch.int64)}
# Where each target is written: a torch.save file, a safetensors file, a DCP folder, a sharded
# safetensors folder (its destination ends with "/"), and the convert options that make them.
TARGETS = {
    "torch": ("model.pt", ["--to", "torch"]),
    "safetensors": ("model.safetensors", ["--to", "safetensors"]),
    "dcp": ("ckpt", ["--to", "dcp"]),
    "sharded": ("st", ["--to", "safetensors", "--max-shard-size", "30MiB"]),
}


@pytest.fixture(scope="module")
def big_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """36 MiB in 12 tensors: every target is a multipart upload of at least 2 parts (16 MiB)."""
    path = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save({f"layers.{i}.weight": torch.full((768, 1024), float(i)) for i in range(12)}, path)
    return path


@pytest.fixture(scope="module")
def old_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("old") / "old.pt"
    torch.save(OLD, path)
    return path


def _convert(src: Path, url: str, target: str, *, cli: bool = False, overwrite: bool = False) -> str:
    """Convert to ``target`` expecting a failure: on the command line (its one-line error) or in
    this process (the exception's message, which the command line prints); the message."""
    if cli:
        return one_line_error(
            run_cli("convert", src, url, *TARGETS[target][1], "--quiet", *["--overwrite"] * overwrite)
        )
    fmt = "safetensors" if target == "sharded" else target
    options: dict[str, Any] = {"max_shard_size": "30MiB"} if target == "sharded" else {}
    with pytest.raises(DCPStudioError) as caught:
        convert(src, url, to=fmt, overwrite=overwrite, **options)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def _url(bucket: str, target: str) -> str:
    return f"s3://{bucket}/out/{TARGETS[target][0]}"


def _snapshot(s3: Any, bucket: str) -> dict[str, bytes]:
    s3.invalidate_cache()
    return {key: s3.cat_file(key) for key in s3.find(bucket)}


def _no_open_uploads(s3_client: Any, bucket: str) -> None:
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def _aborted(s3_server: S3Server, bucket: str) -> list[str]:
    """Objects whose multipart upload was aborted (AbortMultipartUpload: DELETE with uploadId)."""
    return [r.path for r in s3_server.requests("DELETE", bucket) if "uploadId" in r.params and r.status == 204]


@pytest.mark.usefixtures("fast_failures")
@pytest.mark.parametrize("target", list(TARGETS))
def test_an_upload_failing_midway_publishes_nothing(
    s3_server: S3Server, bucket: str, s3: Any, s3_client: Any, big_pt: Path, target: str
) -> None:
    url = _url(bucket, target)
    s3_server.fail_upload_part(1, times=None)  # the first part of each upload goes through
    started = time.monotonic()
    message = _convert(big_pt, url, target, cli=target == "torch")
    elapsed = time.monotonic() - started
    assert message.startswith(f"cannot write {url}") or message.startswith(url), message
    assert "cannot write" in message, message
    assert elapsed < 60
    failed = [r for r in s3_server.requests("PUT", bucket) if r.fault == "fail"]
    assert failed, "no upload part failed: the test did not test anything"
    assert _aborted(s3_server, bucket), "the failed multipart upload was not aborted"
    assert _snapshot(s3, bucket) == {}  # nothing at the destination, nor under a temporary prefix
    _no_open_uploads(s3_client, bucket)
    published = [r.path for r in s3_server.requests("PUT", bucket) if r.path.endswith((".metadata", "index.json"))]
    assert published == []
    print(f"{target}: upload failed after {elapsed:.1f} s: {message}")


@pytest.mark.parametrize("target", ["torch", "dcp"])
def test_cancel_during_an_upload_aborts_it(
    s3_server: S3Server, bucket: str, s3: Any, s3_client: Any, big_pt: Path, target: str
) -> None:
    token = CancelToken()
    seen: list[Progress] = []

    def progress(p: Progress) -> None:
        seen.append(p)
        if any("partNumber" in r.params for r in s3_server.requests("PUT", bucket)):
            token.cancel()  # the first part has reached the store

    with pytest.raises(CancelledError):
        convert(big_pt, _url(bucket, target), to=target, progress=progress, cancel=token)  # type: ignore[arg-type]
    assert token.cancelled and 0 < seen[-1].done_bytes < seen[-1].total_bytes
    assert _aborted(s3_server, bucket)
    _no_open_uploads(s3_client, bucket)
    assert _snapshot(s3, bucket) == {}


def _old_checkpoint(
    s3_server: S3Server, bucket: str, s3: Any, old_sources: Path, target: str
) -> tuple[str, dict[str, bytes]]:
    """The old checkpoint written at ``target``'s URL; the URL and the bucket's contents, with the
    server's log cleared."""
    url = _url(bucket, target)
    fmt = "safetensors" if target == "sharded" else target
    convert(old_sources, url + ("/" if target == "sharded" else ""), to=fmt)  # type: ignore[arg-type]
    before = _snapshot(s3, bucket)
    s3_server.reset()
    return url, before


@pytest.mark.parametrize("target", ["torch", "safetensors", "dcp", "sharded"])
def test_an_existing_destination_is_never_replaced_without_overwrite(
    s3_server: S3Server, bucket: str, s3: Any, old_sources: Path, big_pt: Path, target: str
) -> None:
    url, before = _old_checkpoint(s3_server, bucket, s3, old_sources, target)
    message = _convert(big_pt, url, target, cli=target == "dcp")
    assert message == f"{url} already exists; pass --overwrite to replace it"
    assert {r.method for r in s3_server.log} <= {"GET", "HEAD"}
    assert _snapshot(s3, bucket) == before


def _read_all(url: str) -> dict[str, torch.Tensor]:
    with open_checkpoint(url) as ckpt:
        return {name: ckpt.read_tensor(name) for name in ckpt.entries}


@pytest.mark.parametrize("target", ["torch", "safetensors", "dcp"])
def test_overwrite_replaces_a_checkpoint_whole(
    s3_server: S3Server, bucket: str, s3: Any, s3_client: Any, old_sources: Path, tmp_path: Path, target: str
) -> None:
    url = _url(bucket, target)
    convert(old_sources, url, to=target, **({"files": 2} if target == "dcp" else {}))  # type: ignore[arg-type]
    new = {"new.weight": torch.full((5, 5), 7.0)}
    torch.save(new, tmp_path / "new.pt")
    convert(tmp_path / "new.pt", url, to=target, overwrite=True)  # type: ignore[arg-type]
    assert_same(_read_all(url), new)
    keys = sorted(_snapshot(s3, bucket))
    assert not [k for k in keys if ".dcpstudio-tmp-" in k]
    if target == "dcp":  # the old checkpoint's second data file is gone with it
        assert keys == [f"{bucket}/out/ckpt/{n}" for n in (".metadata", "__0_0.distcp", "dcpstudio-manifest.json")]
    else:
        assert keys == [f"{bucket}/out/{TARGETS[target][0]}"]
    _no_open_uploads(s3_client, bucket)


@pytest.mark.usefixtures("fast_failures")
@pytest.mark.parametrize("target", ["torch", "safetensors", "dcp", "sharded"])
def test_an_overwrite_failing_midway_leaves_the_old_checkpoint_intact(
    s3_server: S3Server, bucket: str, s3: Any, s3_client: Any, old_sources: Path, big_pt: Path, target: str
) -> None:
    url, before = _old_checkpoint(s3_server, bucket, s3, old_sources, target)
    s3_server.fail_upload_part(1, times=None)
    message = _convert(big_pt, url, target, cli=target == "dcp", overwrite=True)
    assert "cannot write" in message, message
    assert [r for r in s3_server.requests("PUT", bucket) if r.fault == "fail"]
    assert _snapshot(s3, bucket) == before  # no temporary prefix left either
    assert_same(_read_all(url), OLD) if target != "sharded" else None
    _no_open_uploads(s3_client, bucket)


@pytest.mark.parametrize("target", ["torch", "dcp"])
def test_a_failure_while_publishing_a_replacement_leaves_the_old_checkpoint_intact(
    s3_server: S3Server, bucket: str, s3: Any, old_sources: Path, tmp_path: Path, target: str
) -> None:
    """The new checkpoint is complete under the temporary prefix; copying it into place fails."""
    url = _url(bucket, target)
    last = f"{bucket}/out/ckpt/.metadata" if target == "dcp" else f"{bucket}/out/model.pt"
    convert(old_sources, url, to=target)  # type: ignore[arg-type]
    before = _snapshot(s3, bucket)
    torch.save({"new.weight": torch.ones(3)}, tmp_path / "new.pt")
    s3_server.reset()
    s3_server.fail(403, method="PUT", match=lambda method, path, query: path == last, times=1)
    with pytest.raises(DCPStudioError, match="cannot write"):
        convert(tmp_path / "new.pt", url, to=target, overwrite=True)  # type: ignore[arg-type]
    assert [r for r in s3_server.requests("PUT") if r.fault == "fail"], "no copy into place was refused"
    assert _snapshot(s3, bucket) == before
    assert_same(_read_all(url), OLD)


def test_when_even_restoring_fails_the_message_says_where_the_old_checkpoint_is_kept(
    s3_server: S3Server, bucket: str, s3: Any, old_sources: Path, tmp_path: Path
) -> None:
    """The destination's .metadata cannot be written at all: neither the new checkpoint nor the old
    one can be put back in place; the old one is kept, whole, where the message says."""
    url = _url(bucket, "dcp")
    convert(old_sources, url, to="dcp")
    torch.save({"new.weight": torch.ones(3)}, tmp_path / "new.pt")
    s3_server.reset()
    last = f"{bucket}/out/ckpt/.metadata"
    s3_server.fail(403, method="PUT", match=lambda method, path, query: path == last, times=None)
    with pytest.raises(DCPStudioError, match="restoring the replaced checkpoint failed too: it is kept at ") as info:
        convert(tmp_path / "new.pt", url, to="dcp", overwrite=True)
    s3_server.reset()
    kept = str(info.value).rsplit("it is kept at ", 1)[1]
    assert kept.startswith(f"s3://{bucket}/out/.ckpt.dcpstudio-tmp-"), kept
    assert_same(_read_all(kept), OLD)
