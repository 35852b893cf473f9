"""Fixtures for remote-checkpoint tests: an S3 API on 127.0.0.1 that plain ``fsspec``/``s3fs``
reach without endpoint or credential arguments (through the standard AWS environment), a fresh
bucket per test, and a directory served over HTTP with byte ranges.

The whole folder is skipped when s3fs, moto's server or aiohttp is missing (``pip install -e
.[test]`` brings them)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._gui import qt_settings, window  # noqa: F401 - fixtures for the window tests here
from tests.remote.servers import RangeHTTPServer, S3Server

# Variables that would send botocore elsewhere or to other credentials than ours.
_FOREIGN_AWS_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@pytest.fixture(scope="session", autouse=True)
def _remote_dependencies() -> None:
    for module in ("s3fs", "moto.server", "aiohttp"):
        pytest.importorskip(module, reason=f"remote tests need {module} (pip install -e .[test])")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 behind the recording proxy, for the session. The environment is set so that
    botocore (hence s3fs, boto3 and a child process) uses the proxy with test credentials:
    ``AWS_ENDPOINT_URL`` is read whenever a client is created, unlike fsspec's
    ``FSSPEC_S3_ENDPOINT_URL``, which fsspec reads once at import. The user's own AWS config and
    fsspec's s3 defaults are hidden; everything is restored at the end of the session."""
    import fsspec.config
    import s3fs

    nowhere = tmp_path_factory.mktemp("aws") / "absent"
    with S3Server() as server, pytest.MonkeyPatch.context() as mp:
        for name in _FOREIGN_AWS_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_ENDPOINT_URL", server.endpoint)
        mp.setenv("AWS_CONFIG_FILE", str(nowhere))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.delitem(fsspec.config.conf, "s3", raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield server
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_client(s3_server: S3Server) -> Any:
    """A boto3 S3 client on the proxy, for setting up and checking a store beside s3fs."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server.endpoint)


@pytest.fixture
def bucket(s3_server: S3Server, s3_client: Any) -> Iterator[str]:
    """A new, empty bucket; s3fs's cached instances (and their listings) and the server's log
    and faults are cleared before the test and its faults again after."""
    import s3fs

    name = f"test-{uuid.uuid4().hex[:24]}"
    s3_client.create_bucket(Bucket=name)
    s3fs.S3FileSystem.clear_instance_cache()
    s3_server.reset()
    yield name
    s3_server.reset()


@dataclass(frozen=True)
class HTTPRoot:
    root: Path
    url: str
    server: RangeHTTPServer


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[HTTPRoot]:
    """An empty directory served read-only over HTTP; files written to ``root`` appear at
    ``url + "/" + relative path``."""
    root = tmp_path / "http"
    root.mkdir()
    with RangeHTTPServer(root) as server:
        yield HTTPRoot(root, server.url, server)


# ---------------------------------------------------------------------------------------------
# Helpers for the checkpoint tests


@pytest.fixture
def s3(bucket: str) -> Any:
    """s3fs as a user's own code would make it (no arguments: the environment points it at the
    proxy), for putting checkpoints into ``bucket`` and looking at what is there."""
    import fsspec

    return fsspec.filesystem("s3")


@pytest.fixture
def fast_failures(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore gives up after one attempt (``AWS_MAX_ATTEMPTS``; children inherit it), so that a
    request failing on purpose costs no back-off: the product's own handling is what is tested."""
    import s3fs

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()


def run_cli(*args: object, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``dcpstudio ARGS`` in a child process with this environment (the proxy's endpoint and test
    credentials included), unless ``env`` replaces it."""
    return subprocess.run(
        [sys.executable, "-m", "dcpstudio", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The message of a failed command, checked to be what a user must see: exit ``code`` and one
    ``dcpstudio: error: ...`` line on stderr, no traceback."""
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcpstudio: error: "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return lines[0].removeprefix("dcpstudio: error: ")
