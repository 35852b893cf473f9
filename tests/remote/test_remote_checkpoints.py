"""Remote checkpoints as a user meets them: what opening, inspecting and reading cost in requests
and bytes (counted by the servers, not by our own counters), and what a read does when the
network drops, or the store refuses or lacks an object.

Conversions are in test_remote_conversions.py, failed and cancelled writes in
test_remote_writes.py, the command line's environment (extras, credentials, ranks) in
test_remote_environment.py."""

from __future__ import annotations

import struct
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import open_checkpoint
from dcpstudio.core.io.remote.locations import RemoteError
from tests._ranks import full_tensor
from tests.conftest import dcp_save
from tests.remote.conftest import HTTPRoot, one_line_error, run_cli
from tests.remote.servers import Request, S3Server

KiB, MiB = 2**10, 2**20
READ_AHEAD = 256 * KiB  # core.io.remote.files.BLOCK: what one small read fetches at most


def _span(r: Request) -> tuple[int, int]:
    """The bytes ``[start, end)`` a GET asked for (each GET of these readers names a range)."""
    assert r.range is not None and r.range.startswith("bytes="), r
    first, _, last = r.range.removeprefix("bytes=").partition("-")
    return int(first), int(last) + 1


def _listings(server: S3Server) -> list[Request]:
    return [r for r in server.requests("GET") if "list-type" in r.params or r.query.startswith("prefix")]


# ---------------------------------------------------------------------------------------------
# Requests and bytes


@pytest.fixture(scope="module")
def hundred_file_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dcp.save of 100 tensors with torch's writer making one data file per tensor."""
    from torch.distributed.checkpoint import FileSystemWriter

    out = tmp_path_factory.mktemp("dcp100") / "ckpt"
    state = {f"layers.{i}.weight": torch.full((16, 16), float(i)) for i in range(100)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp_save(state, storage_writer=FileSystemWriter(out, single_file_per_rank=False))
    assert len(list(out.glob("*.distcp"))) == 100
    return out


def test_opening_a_dcp_of_100_files_makes_at_most_two_gets(
    s3_server: S3Server, bucket: str, s3: Any, hundred_file_dcp: Path
) -> None:
    s3.put(str(hundred_file_dcp), f"{bucket}/ckpt", recursive=True)
    url = f"s3://{bucket}/ckpt"
    s3_server.reset()
    with open_checkpoint(url) as ckpt:
        assert len(ckpt.entries) == 100
        assert ckpt.entries["layers.99.weight"].shape == (16, 16)
        assert ckpt.tree is not None
    gets = s3_server.gets(bucket)
    print(
        f"open of a 100-file DCP: {len(gets)} GETs, {s3_server.bytes_sent(bucket)} bytes, {len(s3_server.log)} requests"
    )
    assert len(gets) <= 2 and {g.path for g in gets} == {f"{bucket}/ckpt/.metadata"}, gets
    assert not _listings(s3_server)

    s3_server.reset()  # the command line, in its own process: the same
    result = run_cli("inspect", url)
    assert result.returncode == 0, result.stderr
    assert "(dcp): 100 tensors" in result.stdout and "    99/" in result.stdout
    gets = s3_server.gets(bucket)
    assert len(gets) <= 2 and {g.path for g in gets} == {f"{bucket}/ckpt/.metadata"}, gets
    assert not _listings(s3_server)


def test_reading_one_tensor_fetches_only_bytes_of_its_chunks(
    s3_server: S3Server, bucket: str, s3: Any, multirank_dcp: Path
) -> None:
    """model.v was saved sharded by columns from 3 ranks: 3 chunks, one in each data file, each
    file also holding other tensors' chunks."""
    s3.put(str(multirank_dcp), f"{bucket}/ckpt", recursive=True)
    with open_checkpoint(f"s3://{bucket}/ckpt") as ckpt:
        chunks = ckpt.chunks("model.v")
        assert len({c.file for c in chunks}) == 3
        s3_server.reset()
        value = ckpt.read_tensor("model.v")
    assert torch.equal(value, full_tensor("model.v"))
    gets = s3_server.gets(bucket)
    inside = []
    for g in gets:
        start, end = _span(g)
        file = g.path.removeprefix(f"{bucket}/ckpt/")
        inside.append(
            any(c.file == file and c.offset <= start and end <= c.offset + c.length for c in chunks)  # type: ignore[operator]
        )
    assert gets and all(inside), [(g.path, g.range) for g in gets]
    print(f"read of a 3-chunk tensor: {[(g.path.rsplit('/', 1)[1], g.range) for g in gets]}, chunks {chunks}")
    assert {g.path.rsplit("/", 1)[1] for g in gets} == {c.file for c in chunks}
    assert s3_server.bytes_sent(f"{bucket}/ckpt/") <= sum(c.length or 0 for c in chunks)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_reading_one_tensor_of_a_file_fetches_only_its_bytes(
    s3_server: S3Server, bucket: str, s3: Any, tmp_path: Path, fmt: str
) -> None:
    """A 4 MiB file of 16 tensors: after opening, reading one fetches only that tensor's bytes."""
    from safetensors.torch import save_file

    state = {f"w{i:02d}": torch.full((256, 256), float(i)) for i in range(16)}
    local = tmp_path / ("m.pt" if fmt == "torch" else "m.safetensors")
    if fmt == "torch":
        torch.save(state, local)
    else:
        save_file(state, local)
    s3.put(str(local), f"{bucket}/{local.name}")
    with open_checkpoint(f"s3://{bucket}/{local.name}") as ckpt:
        (chunk,) = ckpt.chunks("w09")
        s3_server.reset()
        assert torch.equal(ckpt.read_tensor("w09"), state["w09"])
    gets = s3_server.gets(bucket)
    assert gets, "nothing fetched"
    for g in gets:
        start, end = _span(g)
        assert chunk.offset <= start and end <= chunk.offset + chunk.length, (g.range, chunk)  # type: ignore[operator]
    print(f"read of one 256 KiB tensor of a {fmt} file: {[(g.range, g.bytes_sent) for g in gets]}")
    assert s3_server.bytes_sent(bucket) == 256 * 256 * 4


class _Sparse:
    """A file that torch.save writes to, leaving holes for its large (zero) records: a 2 GiB
    checkpoint in a second and a few KiB of disk."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n >= MiB:
            self.f.seek(n, 1)
        else:
            self.f.write(data)
        return n

    def flush(self) -> None:
        self.f.flush()


@pytest.fixture
def big_torch_save(http_root: HTTPRoot) -> Any:
    """A 2 GiB torch.save file of zero tensors served over HTTP (from disk; removed after)."""
    path = http_root.root / "big.pt"
    try:
        from torch.utils.serialization import config

        crc, config.save.compute_crc32 = config.save.compute_crc32, False  # the holes are not read
    except (ImportError, AttributeError):
        config, crc = None, None
    try:
        with path.open("wb") as f:
            torch.save({"embed": torch.zeros(2**28), "out": torch.zeros(2**28), "step": 7}, _Sparse(f))
    finally:
        if config is not None:
            config.save.compute_crc32 = crc
    assert path.stat().st_size > 2 * 2**30
    assert torch.load(path, mmap=True, weights_only=True)["out"].shape == (2**28,)  # torch reads it back
    yield f"{http_root.url}/big.pt"
    path.unlink()


def test_inspecting_a_2gib_torch_save_over_http_fetches_under_1mib(http_root: HTTPRoot, big_torch_save: str) -> None:
    result = run_cli("inspect", big_torch_save)
    assert result.returncode == 0, result.stderr
    assert "embed" in result.stdout and "[268435456]" in result.stdout and "step" in result.stdout
    sent = http_root.server.bytes_sent("big.pt")
    gets = http_root.server.gets("big.pt")
    print(f"inspect of a 2 GiB torch.save over HTTP: {len(gets)} GETs, {sent} bytes")
    assert 0 < sent <= MiB
    assert len([g for g in gets if g.path == "big.pt"]) <= 3  # the README's figure: 3 GETs


def _safetensors_file(path: Path) -> int:
    """An 8 MiB safetensors file of 32 tensors; the size of its header (length prefix included)."""
    from safetensors.torch import save_file

    save_file({f"w{i:02d}": torch.full((256, 256), float(i)) for i in range(32)}, path)
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_inspecting_a_safetensors_file_fetches_its_header_only(
    s3_server: S3Server, bucket: str, s3: Any, tmp_path: Path
) -> None:
    """Only the start of the file: the header, within one read-ahead block, not the tensors."""
    header = _safetensors_file(tmp_path / "m.safetensors")
    s3.put(str(tmp_path / "m.safetensors"), f"{bucket}/m.safetensors")
    s3_server.reset()
    result = run_cli("inspect", f"s3://{bucket}/m.safetensors")
    assert result.returncode == 0, result.stderr
    assert "w31" in result.stdout
    gets = s3_server.gets(bucket)
    print(f"inspect of an 8 MiB safetensors file: {len(gets)} GETs, {s3_server.bytes_sent(bucket)} bytes")
    assert gets and all(_span(g)[0] == 0 and _span(g)[1] <= max(header, READ_AHEAD) for g in gets), gets


def test_opening_a_remote_file_fetches_no_byte_twice(s3_server: S3Server, bucket: str, s3: Any, tmp_path: Path) -> None:
    _safetensors_file(tmp_path / "m.safetensors")
    s3.put(str(tmp_path / "m.safetensors"), f"{bucket}/m.safetensors")
    s3_server.reset()
    with open_checkpoint(f"s3://{bucket}/m.safetensors") as ckpt:
        assert len(ckpt.entries) == 32
    gets = [_span(g) for g in s3_server.gets(bucket)]
    assert len(gets) == len(set(gets)), gets


def test_inspecting_a_file_over_http_asks_for_that_file_only(http_root: HTTPRoot, tmp_path: Path) -> None:
    _safetensors_file(http_root.root / "m.safetensors")
    with open_checkpoint(f"{http_root.url}/m.safetensors") as ckpt:
        assert len(ckpt.entries) == 32
    assert {r.path for r in http_root.server.log} == {"m.safetensors"}, [
        (r.method, r.path) for r in http_root.server.log
    ]


# ---------------------------------------------------------------------------------------------
# Faults while reading


@pytest.fixture(params=["s3", "http"])
def remote_pt(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A 2 MiB torch.save file on S3 or over HTTP: ``(url, server, state, path on the server)``."""
    state = {"w": torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)), "b": torch.arange(10)}
    if request.param == "s3":
        s3_server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("bucket")
        torch.save(state, tmp_path / "m.pt")
        request.getfixturevalue("s3").put(str(tmp_path / "m.pt"), f"{bucket}/m.pt")
        s3_server.reset()
        return f"s3://{bucket}/m.pt", s3_server, state, f"{bucket}/m.pt"
    http_root = request.getfixturevalue("http_root")
    torch.save(state, http_root.root / "m.pt")
    return f"{http_root.url}/m.pt", http_root.server, state, "m.pt"


def _only(path: str) -> Any:
    return lambda method, p, query: p == path


def test_a_read_dropped_once_is_retried_and_succeeds(remote_pt: Any) -> None:
    url, server, state, path = remote_pt
    with open_checkpoint(url) as ckpt:
        server.reset()
        server.drop(64 * KiB, match=_only(path))
        assert torch.equal(ckpt.read_tensor("w"), state["w"])
    gets = server.gets(path)
    assert [g.fault for g in gets][:2] == ["drop", None] and gets[0].range == gets[1].range


def test_a_read_dropped_every_time_fails_on_one_line_in_bounded_time(remote_pt: Any, tmp_path: Path) -> None:
    url, server, _, path = remote_pt
    server.drop(1000, match=_only(path), times=None)
    started = time.monotonic()
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli("export", url, "w", out / "w.npy")
    elapsed = time.monotonic() - started
    message = one_line_error(result)
    assert message.startswith(url) and "cannot read" in message, message
    assert "HTTP 4" not in message and all(g.status == 206 for g in server.gets(path) if g.path == path)
    assert elapsed < 30
    assert not list(out.iterdir())  # no partial output
    print(f"{url.split(':')[0]}: dropped every time: {len(server.gets(path))} GETs, {elapsed:.1f} s: {message}")


@pytest.mark.parametrize(
    ("store", "status"),
    [
        ("s3", 403),
        ("s3", 404),
        ("http", 403),
        ("http", 404),
    ],
)
def test_refused_or_missing_objects_are_one_line_errors(
    request: pytest.FixtureRequest, tmp_path: Path, store: str, status: int
) -> None:
    if store == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("bucket")
        torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
        request.getfixturevalue("s3").put(str(tmp_path / "m.pt"), f"{bucket}/m.pt")
        url = f"s3://{bucket}/m.pt"
    else:
        http_root = request.getfixturevalue("http_root")
        server = http_root.server
        torch.save({"w": torch.ones(3)}, http_root.root / "m.pt")
        url = f"{http_root.url}/m.pt"
    if status == 404:
        url = url.replace("m.pt", "gone.pt")
    else:
        server.fail(403, times=None)
    message = one_line_error(run_cli("inspect", url))
    if status == 404:
        assert message == f"{url}: not found"
    else:
        assert message.startswith(f"{url}: access denied") and "credentials" in message, message


def test_a_refused_read_after_opening_is_a_one_line_error(
    s3_server: S3Server, bucket: str, s3: Any, multirank_dcp: Path
) -> None:
    """The metadata can be read, a data file cannot (a policy on part of a prefix)."""
    s3.put(str(multirank_dcp), f"{bucket}/ckpt", recursive=True)
    with open_checkpoint(f"s3://{bucket}/ckpt") as ckpt:
        s3_server.fail(403, method="GET", match=".distcp", times=None)
        with pytest.raises(RemoteError) as caught:
            ckpt.read_tensor("model.w")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"s3://{bucket}/ckpt/__0_0.distcp: access denied"), message
    assert "AWS_ACCESS_KEY_ID" in message
    assert len(s3_server.gets(f"{bucket}/ckpt/__0_0.distcp")) == 1  # refused: not retried
