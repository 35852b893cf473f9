"""Distributed conversion from a remote source: each rank reads its own ranges over HTTP; a remote
destination is refused (no positioned writes in an object store)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert
from dcpstudio.core.ranks.convert import run_convert


def test_ranks_read_a_remote_source(http_root: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPSTUDIO_SAVE_ID", "remote")
    warnings.simplefilter("ignore")
    torch.save({"w": torch.randn(500, 300), "n": {"b": torch.randn(40)}}, tmp_path / "src.pt")
    shutil.copy(tmp_path / "src.pt", http_root.root / "src.pt")
    url = f"{http_root.url}/src.pt"
    for folder in ("one", "many"):
        (tmp_path / folder).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    convert(url, "out_dcp", to="dcp", dtype="bf16", manifest=False)
    monkeypatch.chdir(tmp_path / "many")
    _, shares = run_convert(url, "out_dcp", ranks=2, timeout=120, to="dcp", dtype="bf16", manifest=False)
    assert all(s.nbytes for s in shares)
    for f in (tmp_path / "one" / "out_dcp").iterdir():
        assert f.read_bytes() == (tmp_path / "many" / "out_dcp" / f.name).read_bytes(), f.name
    with pytest.raises(Exception, match="object store cannot take"):
        run_convert(tmp_path / "src.pt", "s3://bucket/out_dcp", ranks=2, to="dcp", manifest=False)
