"""DCP checkpoints saved by several ranks (DTensor shards, uneven splits, replicas) convert to the
same full tensors as torch's own converter gives."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import format_utils

from dcpstudio.core import dcp_to_torch_save, read_metadata, torch_save_to_dcp
from tests import _ranks
from tests.conftest import assert_same


def test_saved_by_three_ranks(multirank_dcp: Path) -> None:
    files = sorted(p.name for p in multirank_dcp.glob("*.distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    md = read_metadata(multirank_dcp)
    assert len(md.state_dict_metadata["model.w"].chunks) == 3  # type: ignore[union-attr]
    assert len(md.state_dict_metadata["model.v"].chunks) == 3  # type: ignore[union-attr]


def test_converts_to_full_tensors_like_torch(multirank_dcp: Path, tmp_path: Path) -> None:
    dcp_to_torch_save(multirank_dcp, tmp_path / "ours.pt")
    format_utils.dcp_to_torch_save(multirank_dcp, tmp_path / "torch.pt")
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert_same(torch.load(tmp_path / "torch.pt", weights_only=False), ours)
    assert_same(_ranks.expected_state_dict(), ours)


def test_include_picks_sharded_tensors_only(multirank_dcp: Path, tmp_path: Path) -> None:
    dcp_to_torch_save(multirank_dcp, tmp_path / "w.pt", include=r"^model\.(w|v)$")
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    expected = _ranks.expected_state_dict()["model"]
    assert_same({"model": {"w": expected["w"], "v": expected["v"]}}, got)


def test_round_trip_back_to_single_file_dcp(multirank_dcp: Path, tmp_path: Path) -> None:
    dcp_to_torch_save(multirank_dcp, tmp_path / "full.pt")
    torch_save_to_dcp(tmp_path / "full.pt", tmp_path / "again")
    dcp_to_torch_save(tmp_path / "again", tmp_path / "again.pt")
    assert_same(_ranks.expected_state_dict(), torch.load(tmp_path / "again.pt", weights_only=True))
