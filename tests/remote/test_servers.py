"""The remote test servers themselves, driven through s3fs and fsspec's HTTP filesystem as the
product will use them: what each client request looks like in the log, and what each client does
when a fault is injected (what s3fs retries, how often, what it raises)."""

from __future__ import annotations

import http.client
import os
import socket
import time
from typing import Any

import pytest

from tests.remote.conftest import HTTPRoot
from tests.remote.servers import RangeHTTPServer, S3Server

MiB = 2**20


def _s3() -> Any:
    import fsspec

    return fsspec.filesystem("s3")  # no endpoint, no credentials: the environment must do it


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(256)) * (n // 256) + b"z" * (n % 256)


# ---------------------------------------------------------------------------------------------
# S3


def test_plain_s3fs_reaches_the_proxy_through_the_environment(s3_server: S3Server, bucket: str) -> None:
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint
    fs = _s3()
    fs.pipe_file(f"{bucket}/hello.txt", b"hello")
    assert fs.cat_file(f"{bucket}/hello.txt") == b"hello"
    puts = s3_server.requests("PUT", f"{bucket}/hello.txt")
    assert [(r.status, r.fault) for r in puts] == [(200, None)]
    assert [r.bytes_sent for r in s3_server.gets(f"{bucket}/hello.txt")] == [5]


def test_put_get_list_and_the_log_helpers(s3_server: S3Server, bucket: str) -> None:
    fs = _s3()
    files = {f"{bucket}/ckpt/a.distcp": _payload(3000, 1), f"{bucket}/ckpt/.metadata": b"meta", f"{bucket}/x": b"x"}
    fs.pipe(files)
    assert fs.cat(list(files)) == files
    assert sorted(fs.ls(f"{bucket}/ckpt", detail=False)) == [f"{bucket}/ckpt/.metadata", f"{bucket}/ckpt/a.distcp"]
    assert fs.find(bucket) == sorted(files)
    assert fs.size(f"{bucket}/ckpt/a.distcp") == 3000

    assert len(s3_server.requests("PUT", f"{bucket}/ckpt/")) == 2
    assert {r.path for r in s3_server.gets(f"{bucket}/ckpt/")} == {
        f"{bucket}/ckpt/a.distcp",
        f"{bucket}/ckpt/.metadata",
    }
    assert s3_server.bytes_sent(f"{bucket}/ckpt/a.distcp") == 3000
    listings = [r for r in s3_server.requests("GET", bucket) if "list-type" in r.params]
    assert listings and not any(r in s3_server.gets() for r in listings)
    assert s3_server.bytes_sent(bucket) > 3000 + 4 + 1  # listings' XML counts too

    s3_server.reset()
    assert s3_server.log == [] and s3_server.bytes_sent() == 0


def test_ranged_cat_file_is_one_ranged_get(s3_server: S3Server, bucket: str) -> None:
    data = _payload(MiB)
    fs = _s3()
    fs.pipe_file(f"{bucket}/blob", data)
    s3_server.reset()
    # s3fs's signature is cat_file(path, version_id=None, start=None, end=None): keywords only.
    assert fs.cat_file(f"{bucket}/blob", start=1000, end=5096) == data[1000:5096]
    assert [(r.method, r.range, r.status, r.bytes_sent) for r in s3_server.log] == [
        ("GET", "bytes=1000-5095", 206, 4096)
    ]


def test_parallel_ranged_reads(s3_server: S3Server, bucket: str) -> None:
    data = _payload(4 * MiB)
    fs = _s3()
    fs.pipe_file(f"{bucket}/blob", data)
    s3_server.reset()
    starts = [i * 300_000 for i in range(12)]
    ends = [s + 250_000 for s in starts]
    got = fs.cat_ranges([f"{bucket}/blob"] * 12, starts, ends)
    assert got == [data[s:e] for s, e in zip(starts, ends, strict=True)]
    gets = s3_server.gets(f"{bucket}/blob")
    assert sorted(str(r.range) for r in gets) == sorted(f"bytes={s}-{e - 1}" for s, e in zip(starts, ends, strict=True))
    assert all(r.status == 206 and r.bytes_sent == 250_000 for r in gets)


@pytest.mark.parametrize(("status", "error"), [(404, FileNotFoundError), (403, PermissionError)])
def test_injected_errors_surface_as_os_errors(
    s3_server: S3Server, bucket: str, status: int, error: type[Exception]
) -> None:
    fs = _s3()
    fs.pipe_file(f"{bucket}/blob", b"0123456789")
    s3_server.reset()

    s3_server.fail(status, method="GET", match="blob")
    with pytest.raises(error):
        fs.cat_file(f"{bucket}/blob", start=0, end=4)
    assert fs.cat_file(f"{bucket}/blob", start=0, end=4) == b"0123"  # disarmed after one use
    assert [(r.status, r.fault) for r in s3_server.gets(f"{bucket}/blob")] == [(status, "fail"), (206, None)]

    s3_server.fail(status, method="HEAD")
    with pytest.raises(error):
        fs.info(f"{bucket}/blob")


def test_an_injected_error_body_is_s3_xml(s3_server: S3Server, bucket: str, s3_client: Any) -> None:
    from botocore.exceptions import ClientError

    s3_client.put_object(Bucket=bucket, Key="k", Body=b"v")
    s3_server.fail(404, match="/k")
    with pytest.raises(ClientError) as caught:
        s3_client.get_object(Bucket=bucket, Key="k")
    assert caught.value.response["Error"]["Code"] == "NoSuchKey"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_a_500_once_is_retried_by_botocore(s3_server: S3Server, bucket: str) -> None:
    fs = _s3()
    fs.pipe_file(f"{bucket}/blob", b"0123456789")
    s3_server.reset()
    s3_server.fail(500, method="GET")
    assert fs.cat_file(f"{bucket}/blob", start=2, end=5) == b"234"
    assert [r.status for r in s3_server.gets(f"{bucket}/blob")] == [500, 206]


def test_a_dropped_read_once_is_retried_by_s3fs(s3_server: S3Server, bucket: str) -> None:
    data = _payload(2 * MiB)
    fs = _s3()
    fs.pipe_file(f"{bucket}/blob", data)
    s3_server.reset()
    s3_server.drop(1000, match="blob")
    assert fs.cat_file(f"{bucket}/blob", start=10, end=MiB) == data[10:MiB]
    gets = s3_server.gets(f"{bucket}/blob")
    assert [(r.range, r.bytes_sent, r.fault) for r in gets] == [
        (f"bytes=10-{MiB - 1}", 1000, "drop"),
        (f"bytes=10-{MiB - 1}", MiB - 10, None),
    ]


def test_a_read_dropped_every_time_fails_after_s3fs_retries(s3_server: S3Server, bucket: str) -> None:
    import aiohttp

    fs = _s3()
    fs.pipe_file(f"{bucket}/blob", _payload(MiB))
    s3_server.reset()
    s3_server.drop(1000, match="blob", times=None)
    started = time.monotonic()
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(f"{bucket}/blob", start=0, end=MiB // 2)
    elapsed = time.monotonic() - started
    gets = s3_server.gets(f"{bucket}/blob")
    assert len(gets) == fs.retries == 5  # s3fs's own retry loop: 5 attempts, 0.1 s * 1.7**i apart
    assert all(r.fault == "drop" and r.bytes_sent == 1000 for r in gets)
    assert 1.0 < elapsed < 10


def test_multipart_upload_sends_upload_parts(s3_server: S3Server, bucket: str) -> None:
    data = _payload(12 * MiB)
    fs = _s3()
    with fs.open(f"{bucket}/big", "wb", block_size=5 * MiB) as f:
        # s3fs cuts a part whenever its buffer reaches block_size, but sends the whole buffer as
        # that part: one write of 12 MiB would be a single 12 MiB part.
        for i in range(0, len(data), MiB):
            f.write(data[i : i + MiB])
    parts = [r for r in s3_server.requests("PUT", f"{bucket}/big") if "partNumber" in r.params]
    assert [r.params["partNumber"] for r in parts] == ["1", "2", "3"]
    assert s3_server.requests("POST", f"{bucket}/big")[0].query == "uploads"
    assert fs.cat_file(f"{bucket}/big") == data


def test_an_upload_part_failing_once_is_retried(s3_server: S3Server, bucket: str) -> None:
    data = _payload(11 * MiB)
    fs = _s3()
    s3_server.fail_upload_part(1)
    with fs.open(f"{bucket}/big", "wb", block_size=5 * MiB) as f:
        for i in range(0, len(data), MiB):
            f.write(data[i : i + MiB])
    parts = [r for r in s3_server.requests("PUT", f"{bucket}/big") if "partNumber" in r.params]
    assert [(r.params["partNumber"], r.status) for r in parts] == [("1", 200), ("2", 500), ("2", 200), ("3", 200)]
    assert fs.cat_file(f"{bucket}/big") == data


def test_failing_upload_parts_fail_the_close_and_leave_no_object(
    s3_server: S3Server, bucket: str, s3_client: Any
) -> None:
    data = _payload(12 * MiB)
    fs = _s3()
    s3_server.fail_upload_part(2, times=None)
    started = time.monotonic()
    with pytest.raises(OSError, match="internal error"), fs.open(f"{bucket}/big", "wb", block_size=5 * MiB) as f:
        for i in range(0, len(data), MiB):
            f.write(data[i : i + MiB])  # parts 1 and 2 go here; part 3 when closing
    elapsed = time.monotonic() - started
    parts = [r for r in s3_server.requests("PUT", f"{bucket}/big") if "partNumber" in r.params]
    # botocore's legacy retry mode: 5 attempts with random exponential back-off; s3fs adds none.
    assert [(r.params["partNumber"], r.status) for r in parts] == [("1", 200), ("2", 200)] + [("3", 500)] * 5
    assert elapsed < 20
    assert not [r for r in s3_server.requests("POST", f"{bucket}/big") if "uploadId" in r.params]  # not completed
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/big")
    # The multipart upload is left open (s3fs does not abort it on a failed close) ...
    assert len(s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
    # ... until discard() aborts it.
    f.discard()
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert [r.status for r in s3_server.requests("DELETE", f"{bucket}/big")] == [204]


def test_a_chunked_request_body_is_relayed(s3_server: S3Server, bucket: str) -> None:
    pieces = [_payload(70_000, seed) for seed in range(4)]
    conn = http.client.HTTPConnection("127.0.0.1", s3_server.port, timeout=30)
    try:  # moto accepts an unsigned PUT; what matters is the chunked framing reaching it intact
        conn.request("PUT", f"/{bucket}/chunked", body=iter(pieces), encode_chunked=True)
        response = conn.getresponse()
        response.read()
        assert response.status == 200
    finally:
        conn.close()
    assert _s3().cat_file(f"{bucket}/chunked") == b"".join(pieces)


# ---------------------------------------------------------------------------------------------
# HTTP


def _http() -> Any:
    import fsspec

    return fsspec.filesystem("http")


def test_http_ranges_and_info(http_root: HTTPRoot) -> None:
    data = _payload(MiB)
    (http_root.root / "ckpt").mkdir()
    (http_root.root / "ckpt" / "a.distcp").write_bytes(data)
    url = f"{http_root.url}/ckpt/a.distcp"
    fs = _http()
    assert fs.info(url)["size"] == MiB
    assert fs.cat_file(url, start=100, end=612) == data[100:612]
    assert fs.cat_file(url, start=-10) == data[-10:]
    assert fs.cat_file(url) == data
    server = http_root.server
    assert [(r.method, r.range, r.status, r.bytes_sent) for r in server.log] == [
        ("HEAD", None, 200, 0),
        ("GET", "bytes=100-611", 206, 512),
        ("GET", "bytes=-10", 206, 10),
        ("GET", None, 200, MiB),
    ]
    assert len(server.gets("ckpt/")) == 3
    assert server.bytes_sent("ckpt/a") == 512 + 10 + MiB


def test_http_parallel_ranges(http_root: HTTPRoot) -> None:
    data = _payload(3 * MiB)
    (http_root.root / "blob").write_bytes(data)
    starts = [i * 200_000 for i in range(15)]
    ends = [s + 150_000 for s in starts]
    got = _http().cat_ranges([f"{http_root.url}/blob"] * 15, starts, ends)
    assert got == [data[s:e] for s, e in zip(starts, ends, strict=True)]
    assert len(http_root.server.gets("blob")) == 15


def test_http_protocol_details(http_root: HTTPRoot) -> None:
    size = 1000
    (http_root.root / "f").write_bytes(_payload(size))
    (http_root.root / "d").mkdir()
    conn = http.client.HTTPConnection("127.0.0.1", http_root.server.port, timeout=30)

    def ask(method: str, path: str, rng: str | None = None) -> tuple[int, dict[str, str], bytes]:
        conn.request(method, path, headers={"Range": rng} if rng else {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()

    try:  # one kept-alive connection for all of them
        status, headers, body = ask("GET", "/f")
        assert (status, len(body), headers["Content-Length"], headers["Accept-Ranges"]) == (200, size, "1000", "bytes")
        assert headers["ETag"] and headers["Last-Modified"].endswith("GMT")
        cases = {
            "bytes=0-0": (206, "bytes 0-0/1000", 1),
            "bytes=990-": (206, "bytes 990-999/1000", 10),
            "bytes=-7": (206, "bytes 993-999/1000", 7),
            "bytes=900-5000": (206, "bytes 900-999/1000", 100),
            "bytes=1000-": (416, "bytes */1000", 0),
            "bytes=-0": (416, "bytes */1000", 0),
            "bytes=0-1,5-6": (200, None, size),  # several ranges: the whole file, as RFC 9110 allows
        }
        for rng, (want_status, want_range, want_len) in cases.items():
            status, headers, body = ask("GET", "/f", rng)
            assert (status, headers.get("Content-Range"), len(body)) == (want_status, want_range, want_len), rng
            assert int(headers["Content-Length"]) == want_len, rng
        status, headers, body = ask("HEAD", "/f", "bytes=10-19")
        assert (status, headers["Content-Length"], body) == (206, "10", b"")
        for missing in ("/nope", "/d", "/d/", "/../f", "/%2e%2e/f"):
            assert ask("GET", missing)[0] == 404, missing
    finally:
        conn.close()


def test_http_missing_and_injected_errors(http_root: HTTPRoot) -> None:
    import aiohttp

    (http_root.root / "f").write_bytes(b"0123456789")
    fs = _http()
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{http_root.url}/nope")
    http_root.server.fail(404, match="f")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{http_root.url}/f", start=0, end=3)
    assert fs.cat_file(f"{http_root.url}/f", start=0, end=3) == b"012"
    http_root.server.fail(500, method="GET", times=2)
    for _ in range(2):
        with pytest.raises(aiohttp.ClientResponseError, match="500"):  # not an OSError; no retry
            fs.cat_file(f"{http_root.url}/f", start=0, end=3)
    assert [(r.status, r.fault) for r in http_root.server.gets("f")] == [
        (404, "fail"),
        (206, None),
        (500, "fail"),
        (500, "fail"),
    ]


def test_http_dropped_read_is_not_retried(http_root: HTTPRoot) -> None:
    import aiohttp

    data = _payload(MiB)
    (http_root.root / "f").write_bytes(data)
    fs = _http()
    http_root.server.drop(4096)
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(f"{http_root.url}/f", start=0, end=500_000)
    assert fs.cat_file(f"{http_root.url}/f", start=0, end=500_000) == data[:500_000]
    assert [(r.bytes_sent, r.fault) for r in http_root.server.gets("f")] == [(4096, "drop"), (500_000, None)]


# ---------------------------------------------------------------------------------------------
# Shutdown


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_servers_stop_cleanly_with_connections_open(tmp_path: Any) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    with RangeHTTPServer(tmp_path) as http_server:
        conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=5)
        conn.request("GET", "/f")
        assert conn.getresponse().read() == b"abc"  # the connection stays open, its thread waiting
        http_port = http_server.port
    assert _refused(http_port)
    conn.close()

    with S3Server() as s3:
        proxy_port, moto_port = s3.port, s3._moto_port
        conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=5)
        conn.request("GET", "/")
        conn.getresponse().read()
    assert _refused(proxy_port) and _refused(moto_port)
    conn.close()
