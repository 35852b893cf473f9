"""Conversions with a remote source, a remote destination or both, for every pair of formats: the
output, read back with torch's and safetensors' own loaders, holds the source's tensors bit for
bit, as the same conversion between local paths does; folders appear with their ``.metadata`` or
index last; an HTTP source converts like a local one."""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert, open_checkpoint
from tests.conftest import assert_same, dcp_load, dcp_save
from tests.remote.conftest import HTTPRoot, one_line_error, run_cli
from tests.remote.servers import S3Server

FORMATS = ("dcp", "torch", "safetensors")
NAME = {"dcp": "ckpt", "torch": "model.pt", "safetensors": "model.safetensors"}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.attn.weight": torch.randn(32, 32, generator=g).bfloat16(),
        "model.layers.0.attn.bias": torch.randn(32, generator=g).half(),
        "model.layers.0.mask": torch.rand(8, generator=g) > 0.5,
        "model.positions": torch.arange(40),
        "model.codes": torch.randint(0, 255, (17,), generator=g, dtype=torch.uint8),
        "model.scale": torch.tensor(0.125, dtype=torch.float64),
    }


STATE = _state()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The state in each format, written by torch's and safetensors' own writers."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter

    d = tmp_path_factory.mktemp("sources")
    torch.save(STATE, d / NAME["torch"])
    save_file(STATE, d / NAME["safetensors"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp_save(dict(STATE), storage_writer=FileSystemWriter(d / NAME["dcp"], single_file_per_rank=False))
    return {fmt: d / NAME[fmt] for fmt in FORMATS}


@pytest.fixture(scope="module")
def reference(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``reference(src, dst)``: the same conversion between local paths (made once)."""
    made: dict[tuple[str, str], Path] = {}

    def get(src: str, dst: str) -> Path:
        if (src, dst) not in made:
            out = tmp_path_factory.mktemp(f"ref-{src}-{dst}") / NAME[dst]
            convert(sources[src], out, to=dst)  # type: ignore[arg-type]
            made[src, dst] = out
        return made[src, dst]

    return get


def load(path: Path, fmt: str) -> dict[str, Any]:
    """A local output read back with torch's or safetensors' own loaders, not ours."""
    if fmt == "torch":
        return dict(torch.load(path, weights_only=True))
    if fmt == "safetensors":
        from safetensors.torch import load_file

        out: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
            out.update(load_file(f))
        return out
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(path)
    assert sorted(reader.read_metadata().state_dict_metadata) == sorted(STATE)
    state = {k: torch.empty_like(v) for k, v in STATE.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp_load(state, storage_reader=reader)
    return state


@pytest.mark.parametrize("direction", ["remote-to-local", "local-to-remote", "remote-to-remote"])
@pytest.mark.parametrize("dst", FORMATS)
@pytest.mark.parametrize("src", FORMATS)
def test_conversions_with_s3_round_trip_bit_exactly(
    s3_server: S3Server,
    bucket: str,
    s3: Any,
    sources: dict[str, Path],
    reference: Callable[[str, str], Path],
    tmp_path: Path,
    src: str,
    dst: str,
    direction: str,
) -> None:
    source: Path | str = sources[src]
    if direction != "local-to-remote":
        s3.put(str(source), f"{bucket}/in/{NAME[src]}", recursive=src == "dcp")
        source = f"s3://{bucket}/in/{NAME[src]}"
    local_out = tmp_path / NAME[dst]
    target = local_out if direction == "remote-to-local" else f"s3://{bucket}/out/{NAME[dst]}"

    result = convert(source, target, to=dst)  # type: ignore[arg-type]
    assert (result.tensors, result.values) == (len(STATE), 0)

    if isinstance(target, str):
        with open_checkpoint(target) as ckpt:  # read in place through the remote reader ...
            assert sorted(ckpt.entries) == sorted(STATE)
            for name, tensor in STATE.items():
                assert_same(ckpt.read_tensor(name), tensor, name)
        s3.invalidate_cache()
        assert not [k for k in s3.find(bucket) if ".dcpstudio-tmp-" in k]
        s3.get(f"{bucket}/out/{NAME[dst]}", str(local_out), recursive=dst == "dcp")  # ... and downloaded
    got = load(local_out, dst)
    assert_same(got, load(reference(src, dst), dst))
    assert_same(got, STATE)


def test_remote_folders_appear_with_their_metadata_or_index_last(
    s3_server: S3Server, bucket: str, s3: Any, sources: dict[str, Path], tmp_path: Path
) -> None:
    def written(prefix: str) -> list[str]:
        """Objects in the order they became visible: a PUT, or a multipart upload's completion."""
        return [
            r.path.removeprefix(prefix)
            for r in s3_server.log
            if r.path.startswith(prefix)
            and r.status == 200
            and (
                (r.method == "PUT" and "partNumber" not in r.params) or (r.method == "POST" and "uploadId" in r.params)
            )
        ]

    convert(sources["torch"], f"s3://{bucket}/ckpt", to="dcp", files=3)
    order = written(f"{bucket}/ckpt/")
    assert len(order) >= 3 and order[-1] == ".metadata" and order.count(".metadata") == 1, order

    convert(sources["torch"], f"s3://{bucket}/st", to="safetensors", max_shard_size=9000)
    order = written(f"{bucket}/st/")
    assert len(order) >= 3 and order[-1] == "model.safetensors.index.json", order
    s3.get(f"{bucket}/st", str(tmp_path / "st"), recursive=True)
    assert_same(load(tmp_path / "st", "safetensors"), STATE)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_remote_sharded_safetensors_folder_opens_and_converts(
    request: pytest.FixtureRequest, sources: dict[str, Path], tmp_path: Path, store: str
) -> None:
    sharded = tmp_path / "sharded"
    convert(sources["torch"], sharded, to="safetensors", max_shard_size=9000)
    assert len(list(sharded.glob("*.safetensors"))) >= 2
    if store == "s3":
        bucket = request.getfixturevalue("bucket")
        request.getfixturevalue("s3").put(str(sharded), f"{bucket}/st", recursive=True)
        url = f"s3://{bucket}/st"
    else:
        http_root = request.getfixturevalue("http_root")
        shutil.copytree(sharded, http_root.root / "st")
        url = f"{http_root.url}/st"
    with open_checkpoint(url) as ckpt:
        assert_same({name: ckpt.read_tensor(name) for name in ckpt.entries}, STATE)
    convert(url, tmp_path / "back.pt", to="torch")
    assert_same(load(tmp_path / "back.pt", "torch"), STATE)


@pytest.mark.parametrize("src", FORMATS)
def test_http_sources_convert_to_every_format(
    http_root: HTTPRoot, sources: dict[str, Path], tmp_path: Path, src: str
) -> None:
    if src == "dcp":
        shutil.copytree(sources[src], http_root.root / NAME[src])
    else:
        shutil.copy(sources[src], http_root.root / NAME[src])
    url = f"{http_root.url}/{NAME[src]}"
    for dst in FORMATS:
        out = tmp_path / dst / NAME[dst]
        out.parent.mkdir()
        convert(url, out, to=dst)  # type: ignore[arg-type]
        assert_same(load(out, dst), STATE, f"{src} -> {dst}")
    assert {r.method for r in http_root.server.log} <= {"GET", "HEAD"}


# ---------------------------------------------------------------------------------------------
# A conversion streams each source file with one GET; a dropped stream is resumed where it broke


@pytest.fixture(scope="module")
def streamed_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 MiB in 3 tensors whose every element differs: bytes resumed at a wrong offset show."""
    path = tmp_path_factory.mktemp("streamed") / "big.pt"
    n = 2**21
    torch.save({f"t{i}": torch.arange(i * n, (i + 1) * n, dtype=torch.float32) for i in range(3)}, path)
    return path


def _remote_copy(request: pytest.FixtureRequest, local: Path, store: str) -> tuple[str, Any, str]:
    """``local`` on S3 or over HTTP: its URL, the server and its path in the server's log."""
    if store == "s3":
        bucket = request.getfixturevalue("bucket")
        request.getfixturevalue("s3").put(str(local), f"{bucket}/{local.name}")
        server = request.getfixturevalue("s3_server")
        server.reset()
        return f"s3://{bucket}/{local.name}", server, f"{bucket}/{local.name}"
    http_root = request.getfixturevalue("http_root")
    shutil.copy(local, http_root.root / local.name)
    return f"{http_root.url}/{local.name}", http_root.server, local.name


def _span(r: Any) -> tuple[int, int]:
    first, _, last = r.range.removeprefix("bytes=").partition("-")
    return int(first), int(last) + 1


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_stream_dropped_midway_is_resumed_where_it_broke(
    request: pytest.FixtureRequest, streamed_pt: Path, tmp_path: Path, store: str
) -> None:
    url, server, path = _remote_copy(request, streamed_pt, store)
    # the stream is the GET running to the end of the object (the first large read, 8 MiB, is a
    # plain range request: a stream starts with the read that continues it)
    server.drop(5 * 2**20, match=lambda method, p, query: p == path, longer_than=9 * 2**20)
    convert(url, tmp_path / "out.safetensors", to="safetensors")
    assert_same(load(tmp_path / "out.safetensors", "safetensors"), torch.load(streamed_pt, weights_only=True))
    gets = [g for g in server.gets(path) if g.path == path]
    long = [g for g in gets if _span(g)[1] - _span(g)[0] > 9 * 2**20]
    print(f"{store}: stream GETs {[(g.range, g.bytes_sent, g.fault) for g in long]}")
    assert [g.fault for g in long] == ["drop", None], long
    (start, end), (again, end_again) = _span(long[0]), _span(long[1])
    assert start < again <= start + long[0].bytes_sent and end_again == end  # not from the start again
    assert sum(g.bytes_sent for g in gets) < streamed_pt.stat().st_size + 6 * 2**20


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_stream_dropped_every_time_fails_on_one_line(
    request: pytest.FixtureRequest, streamed_pt: Path, tmp_path: Path, store: str
) -> None:
    url, server, path = _remote_copy(request, streamed_pt, store)
    server.drop(1000, match=lambda method, p, query: p == path, longer_than=2**20, times=None)
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    message = one_line_error(run_cli("convert", url, out / "m.safetensors", "--to", "safetensors", "--quiet"))
    elapsed = time.monotonic() - started
    assert message.startswith(f"{url}: cannot read"), message
    assert elapsed < 30 and not list(out.iterdir())
    gets = [g for g in server.gets(path) if g.path == path]
    print(f"{store}: stream dropped every time: {len(gets)} GETs, {elapsed:.1f} s: {message}")


def test_a_layout_for_ranks_is_refused_for_an_upload_in_one_line(bucket: str, tmp_path: Path, s3: Any) -> None:
    """--for-ranks streams a chunk's bytes and fills its archive's CRC in before them: an upload
    cannot seek back, so a remote destination is refused before anything is uploaded (it failed
    midway with "seek")."""
    src = tmp_path / "m.pt"
    torch.save(STATE, src)
    result = run_cli("convert", src, f"s3://{bucket}/out/r2", "--for-ranks", "2")
    assert "--for-ranks writes each chunk's archive" in one_line_error(result)
    assert not s3.ls(f"{bucket}/", detail=False)
