"""What surrounds a remote checkpoint: the optional backend a URL scheme needs, credentials that
must never show (not in any error, not in the window's settings), and loading a checkpoint in S3
on several ranks, each its own process reaching the store through the environment it inherits."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert, diff, open_checkpoint
from tests.remote.conftest import HTTPRoot, one_line_error, run_cli
from tests.remote.servers import S3Server

# ---------------------------------------------------------------------------------------------
# Missing extras (gs:// is in test_remote_names.py)


@pytest.mark.parametrize(
    ("url", "extra", "backend"),
    [("az://container/ckpt", "azure", "adlfs"), ("hf://org/repo/model.safetensors", "hf", "huggingface_hub")],
)
def test_a_scheme_whose_backend_is_missing_names_the_extra_to_install(url: str, extra: str, backend: str) -> None:
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed here")
    message = one_line_error(run_cli("inspect", url))
    assert message.startswith(url) and message.endswith(f"pip install 'dcpstudio[{extra}]'"), message


# ---------------------------------------------------------------------------------------------
# Credentials

ACCESS_KEY = "AKIAXDCPSTUDIOKEYID7"
SECRET_KEY = "wJalrXUtnFEMI-dcpstudio-s3cr3t-Value"
URL_PASSWORD = "pa55-in-the-url"
URL_TOKEN = "sig-in-the-query-0123456789"
SECRETS = (ACCESS_KEY, SECRET_KEY, URL_PASSWORD, URL_TOKEN)


@pytest.fixture
def secret_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials of our own (moto takes any) for this process and its children."""
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    return dict(os.environ)


def _with_user(url: str) -> str:
    return url.replace("://", f"://user:{URL_PASSWORD}@")


def test_no_credential_ever_appears_in_an_error(
    s3_server: S3Server, bucket: str, s3: Any, http_root: HTTPRoot, secret_env: dict[str, str], tmp_path: Path
) -> None:
    torch.save({"w": torch.ones(4)}, tmp_path / "m.pt")
    s3.put(str(tmp_path / "m.pt"), f"{bucket}/m.pt")
    torch.save({"w": torch.zeros(512, 1024)}, http_root.root / "m.pt")
    http = _with_user(http_root.url)
    outputs = []

    def failing(*args: object, fault: Any = None) -> None:
        s3_server.reset()
        http_root.server.reset()
        if fault is not None:
            fault()
        result = run_cli(*args, env=secret_env)
        one_line_error(result, 2 if args[0] == "verify" else 1)
        outputs.append(result.stdout + result.stderr)

    failing("inspect", f"s3://{bucket}/m.pt", fault=lambda: s3_server.fail(403, times=None))
    failing(
        "convert", tmp_path / "m.pt", f"s3://{bucket}/out.pt", "--to", "torch",
        fault=lambda: s3_server.fail(500, method="PUT", times=None),
    )  # fmt: skip
    failing("verify", f"s3://{bucket}/m.pt", f"{http}/missing.pt?X-Amz-Signature={URL_TOKEN}")
    failing("inspect", f"{http}/m.pt", fault=lambda: http_root.server.fail(403, times=None))
    failing("export", f"{http}/m.pt", "w", tmp_path / "w.npy", fault=lambda: http_root.server.drop(10, times=None))
    for text in outputs:
        assert not [s for s in SECRETS if s in text], text
    assert sum(http_root.url in text for text in outputs) == 3  # the URLs are named, without their secrets


def test_no_credential_is_written_to_the_window_settings(
    qtbot: Any,
    window: Any,
    qt_settings: Path,
    s3_server: S3Server,
    bucket: str,
    s3: Any,
    http_root: HTTPRoot,
    secret_env: dict[str, str],
    tmp_path: Path,
) -> None:
    torch.save({"w": torch.ones(4)}, tmp_path / "m.pt")
    s3.put(str(tmp_path / "m.pt"), f"{bucket}/m.pt")
    torch.save({"w": torch.ones(4)}, http_root.root / "m.pt")
    seen: list[str] = []

    def opened(url: str) -> None:
        shown = url.replace(f"user:{URL_PASSWORD}@", "")
        window.open_path(url)
        qtbot.waitUntil(
            lambda: window.ckpt is not None and window.settings.recent_urls()[:1] == [shown], timeout=30_000
        )
        seen.extend([window.windowTitle(), window.remote_status.where.text(), window.message_bar.text()])

    opened(f"s3://{bucket}/m.pt")
    opened(f"{_with_user(http_root.url)}/m.pt")
    assert window.settings.recent_urls() == [f"{http_root.url}/m.pt", f"s3://{bucket}/m.pt"]
    window.open_path(f"{_with_user(http_root.url)}/missing.pt?X-Amz-Signature={URL_TOKEN}")  # an error
    qtbot.waitUntil(lambda: window.message_bar.level == "error", timeout=30_000)
    seen.append(window.message_bar.text())
    assert f"{http_root.url}/missing.pt" in seen[-1]
    window.close()
    files = [p for p in qt_settings.rglob("*") if p.is_file()]
    stored = b"".join(p.read_bytes() for p in files)
    assert f"s3://{bucket}/m.pt".encode() in stored, files
    assert not [s for s in SECRETS if s.encode() in stored]
    assert not [s for s in SECRETS for text in seen if s in text], seen


def test_a_signed_url_of_a_file_opens(http_root: HTTPRoot) -> None:
    torch.save({"w": torch.ones(4)}, http_root.root / "m.pt")
    result = run_cli("inspect", f"{http_root.url}/m.pt?X-Amz-Signature={URL_TOKEN}")
    assert result.returncode == 0, result.stderr
    assert "w  float32 [4]" in result.stdout


# ---------------------------------------------------------------------------------------------
# Several ranks (the window's Load panel on a torch.save in S3 is in tests/app/test_remote_load.py)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dcp", "torch"])
def test_load_on_two_ranks_reads_a_checkpoint_in_s3(
    s3_server: S3Server, bucket: str, s3: Any, multirank_dcp: Path, rich_pt: Path, kind: str
) -> None:
    """Each rank opens the URL itself (through the environment it inherits) and checks every shard
    it loaded against the same region read directly from the store."""
    if kind == "dcp":  # written by dcp.save on 3 ranks: each of the 2 ranks reads parts of 3 files
        s3.put(str(multirank_dcp), f"{bucket}/ckpt", recursive=True)
        url, files = f"s3://{bucket}/ckpt", {f"{bucket}/ckpt/__{r}_0.distcp" for r in range(3)}
    else:
        s3.put(str(rich_pt), f"{bucket}/rich.pt")
        url, files = f"s3://{bucket}/rich.pt", {f"{bucket}/rich.pt"}
    s3_server.reset()
    result = run_cli("load", url, "--ranks", "2", "--json", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout)
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["ok"] and r["checked"] > 0 and not r["mismatches"] for r in reports), reports
    assert files <= {g.path for g in s3_server.gets(bucket)}  # the data came from the store


def test_verify_compares_a_local_and_a_remote_checkpoint(
    s3_server: S3Server, bucket: str, rich_pt: Path, tmp_path: Path
) -> None:
    convert(rich_pt, f"s3://{bucket}/same", to="dcp")
    with open_checkpoint(rich_pt) as a, open_checkpoint(f"s3://{bucket}/same") as b:
        assert diff(a, b).equal
    state = torch.load(rich_pt, weights_only=True)
    state["model"]["i64"][3] = -1
    torch.save(state, tmp_path / "other.pt")
    convert(tmp_path / "other.pt", f"s3://{bucket}/other", to="dcp")
    other = run_cli("verify", rich_pt, f"s3://{bucket}/other")
    assert other.returncode == 1 and "model.i64" in other.stdout, other.stdout + other.stderr
