"""Load on ranks with a checkpoint in S3: every rank is its own process and opens the URL itself,
so this needs a real server (moto's, on 127.0.0.1, as s3fs's own tests use), not an in-memory store."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import Qt

from dcpstudio.window.main_window import MainWindow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    """A bucket on a local S3 server; the ranks find it through the environment they inherit."""
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        for key, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }.items():
            env.setenv(key, value)
        import s3fs

        bucket = f"dcpstudio-{uuid.uuid4().hex[:8]}"
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(bucket)
        try:
            yield bucket
        finally:
            s3fs.S3FileSystem.clear_instance_cache()  # no later test may reach this server through a cached one
            server.stop()


def test_load_on_ranks_reads_a_checkpoint_in_s3(qtbot: Any, window: MainWindow, rich_pt: Path, s3_bucket: str) -> None:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).put(str(rich_pt), f"{s3_bucket}/rich.pt")
    url = f"s3://{s3_bucket}/rich.pt"
    window.open_path(url)
    qtbot.waitUntil(lambda: window.ckpt is not None and not window.jobs["open"].running, timeout=60_000)
    assert window.remote_status.where.text() == f"☁ {url}"
    window.actions_tabs.setCurrentWidget(window.load_panel)
    window.load_panel.ranks.setValue(2)
    qtbot.mouseClick(window.load_panel.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.jobs["load"].running, timeout=180_000)
    table = window.load_panel.table
    assert table.rowCount() == 2, window.load_panel.status.text()
    assert all(table.item(r, 7).text().startswith("ok") for r in range(2)), [table.item(r, 7).text() for r in range(2)]
    assert "Every shard matches" in window.load_panel.status.text()
