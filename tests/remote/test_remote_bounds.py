"""Remote reads are bounded whatever the server does: a server that ignores ``Range``, sends more
than asked, lies in its Content-Length or trickles is cut off with one line (or, for a small
object without range support, read from its start), within the operation's deadline; a signal
during a remote read ends the command as it ends a local one, with nothing else on stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcpstudio.core.io.remote import calls as _remote_calls
from dcpstudio.core.io.remote.locations import RemoteError, RemotePath
from dcpstudio.core.io.remote.stream import Stream
from tests.remote.bad_servers import BadHTTPServer
from tests.remote.conftest import one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20
TINY = bytes(range(128))


def _read(url: str, offset: int, n: int) -> bytes:
    with RemotePath(url).open_read() as f:
        out = bytearray(n)
        assert f.pread(offset, memoryview(out)) == n
        return bytes(out)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short bounds, for this process and the commands it runs."""
    monkeypatch.setenv("DCPSTUDIO_REMOTE_DEADLINE", "1.5")


def _serve(mode: str, objects: dict[str, bytes] | None = None, **kw: object) -> BadHTTPServer:
    return BadHTTPServer(objects if objects is not None else {"tiny": TINY}, mode, **kw)  # type: ignore[arg-type]


@pytest.fixture
def ignores_range() -> Iterator[BadHTTPServer]:
    """A 128-byte object whose server answers any GET with 2 GiB (generated, not held)."""
    with _serve("ignore_range", body=2 * GiB) as server:
        yield server


def test_a_server_sending_gigabytes_for_a_small_object_is_refused_unread(ignores_range: BadHTTPServer) -> None:
    t = time.monotonic()
    with pytest.raises(RemoteError, match=r"tiny: the server does not honour range requests \(.*2\.0 GiB"):
        _read(f"{ignores_range.url}/tiny", 0, 16)
    assert time.monotonic() - t < 5
    assert ignores_range.sent < 64 * MiB  # what the socket buffers took before the client hung up


def test_the_command_says_so_in_one_line(ignores_range: BadHTTPServer) -> None:
    message = one_line_error(run_cli("inspect", f"{ignores_range.url}/tiny", timeout=60))
    assert "does not honour range requests" in message and ignores_range.sent < 64 * MiB


def test_a_small_object_without_range_support_is_read_from_its_start() -> None:
    with _serve("ignore_range", length=False) as server:  # 200, whole object, no length, then closes
        assert _read(f"{server.url}/tiny", 100, 20) == TINY[100:120]
    with _serve("ignore_range") as server:  # 200 with an honest Content-Length
        assert _read(f"{server.url}/tiny", 3, 7) == TINY[3:10]


def test_a_small_safetensors_file_opens_from_a_server_without_ranges(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save

    blob = save({"w": torch.arange(6.0)})
    with _serve("ignore_range", {"m.safetensors": blob}) as server:
        result = run_cli("inspect", f"{server.url}/m.safetensors", timeout=60)
    assert result.returncode == 0 and "w" in result.stdout, result.stderr


def test_a_large_object_whose_server_ignores_ranges_is_refused() -> None:
    big = bytes(6 * MiB)
    with _serve("ignore_range", {"big": big}) as server:
        with pytest.raises(RemoteError, match=r"does not honour range requests .*sent the whole object"):
            _read(f"{server.url}/big", 5 * MiB, 1000)
        assert server.sent < 64 * MiB
        assert _read(f"{server.url}/big", 0, 1000) == big[:1000]  # from its start: the first bytes only
    with _serve("ignore_range", {"big": big}, length=False) as server:  # no length: the rest is not an error
        assert _read(f"{server.url}/big", 0, 1000) == big[:1000]


def test_a_whole_object_answer_longer_than_the_object_is_refused() -> None:
    with _serve("ignore_range", body=2 * GiB, length=False) as server:
        with pytest.raises(RemoteError, match=r"does not honour range requests \(it sent more than bytes 0-127\)"):
            _read(f"{server.url}/tiny", 0, 16)
        assert server.sent < 64 * MiB


def test_a_range_followed_by_more_bytes_is_cut_off_and_refused() -> None:
    with _serve("overflow", extra=2 * GiB) as server:
        with pytest.raises(RemoteError, match=r"does not honour range requests \(it sent more than bytes 0-127\)"):
            _read(f"{server.url}/tiny", 8, 8)  # read ahead: the whole object is asked for
        assert server.sent < 64 * MiB


def test_a_content_length_beyond_the_range_is_refused_before_the_body() -> None:
    with _serve("lie", body=2 * GiB) as server:
        with pytest.raises(RemoteError, match=r"does not honour range requests \(.*announced 2\.0 GiB"):
            _read(f"{server.url}/tiny", 0, 16)
        assert server.sent < 64 * MiB


def test_a_trickling_server_is_cut_off_at_the_deadline(quick: None) -> None:
    with _serve("trickle", interval=0.2) as server:
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"no complete answer within 1\.5 s .*DCPSTUDIO_REMOTE_DEADLINE"):
            _read(f"{server.url}/tiny", 0, 128)
        assert time.monotonic() - t < 1.5 + 1


def test_a_transfer_below_the_minimum_rate_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_remote_calls, "RATE_GRACE", 0.3)
    monkeypatch.setenv("DCPSTUDIO_REMOTE_MIN_RATE", "1000")  # bytes/s; the server sends ~20
    with _serve("trickle", interval=0.05) as server:
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"sent \d+ of 128 bytes in 0 s, slower than .*DCPSTUDIO_REMOTE_MIN_RATE"):
            _read(f"{server.url}/tiny", 0, 128)
        assert time.monotonic() - t < 1.5


def test_a_trickling_stream_is_cut_off_too(quick: None) -> None:
    big = bytes(20 * MiB)
    with _serve("trickle", {"big": big}, interval=0.2) as server:
        where = RemotePath(f"{server.url}/big")
        stream = Stream(where.fs, where.path, where.url, str(where), 4096, len(big))
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"no complete answer within 1\.5 s"):
            stream.read(4096, memoryview(bytearray(1 << 20)))
        stream.close()
        assert time.monotonic() - t < 1.5 + 1


def test_a_stream_from_a_server_ignoring_ranges_is_refused() -> None:
    big = bytes(20 * MiB)
    with _serve("ignore_range", {"big": big}) as server:
        where = RemotePath(f"{server.url}/big")
        stream = Stream(where.fs, where.path, where.url, str(where), 8 * MiB, len(big))
        with pytest.raises(RemoteError, match="does not honour range requests"):
            stream.read(8 * MiB, memoryview(bytearray(1 << 20)))
        stream.close()
        assert server.sent < 64 * MiB


def test_bad_bounds_in_the_environment_are_one_line_errors(ignores_range: BadHTTPServer) -> None:
    env = {**os.environ, "DCPSTUDIO_REMOTE_DEADLINE": "soon"}
    message = one_line_error(run_cli("inspect", f"{ignores_range.url}/tiny", timeout=60, env=env))
    assert message == "DCPSTUDIO_REMOTE_DEADLINE must be a positive number of seconds, not 'soon'"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("signum", "code", "said"), [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_during_a_remote_read_ends_quietly(signum: int, code: int, said: str) -> None:
    with _serve("trickle", interval=0.5) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dcpstudio", "inspect", f"{server.url}/tiny"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,
        )
        deadline = time.monotonic() + 30
        while server.gets == 0 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3)  # the body is trickling in
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [f"dcpstudio: {said}; nothing was written"], err
