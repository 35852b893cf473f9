"""Conversions agree with torch's own converters and with dcp.load, both ways."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import format_utils

from dcpstudio.core import dcp_to_torch_save, torch_save_to_dcp
from tests.conftest import assert_same, dcp_load, rich_state_dict


def test_torch_to_dcp_is_read_by_torch_and_dcp_load(rich_pt: Path, tmp_path: Path) -> None:
    result = torch_save_to_dcp(rich_pt, tmp_path / "ours_dcp")
    assert result.tensors == 20 and result.target == "dcp"

    format_utils.dcp_to_torch_save(tmp_path / "ours_dcp", tmp_path / "torch_back.pt")
    back = torch.load(tmp_path / "torch_back.pt", weights_only=False)
    assert_same(rich_state_dict(), back)

    target = {"model": {k: torch.empty_like(v) for k, v in rich_state_dict()["model"].items()}}
    dcp_load(target, checkpoint_id=tmp_path / "ours_dcp")
    assert_same(rich_state_dict()["model"], target["model"])


def test_dcp_to_torch_matches_torch_converter(rich_pt: Path, tmp_path: Path) -> None:
    format_utils.torch_save_to_dcp(rich_pt, tmp_path / "torch_dcp")
    format_utils.dcp_to_torch_save(tmp_path / "torch_dcp", tmp_path / "reference.pt")
    dcp_to_torch_save(tmp_path / "torch_dcp", tmp_path / "ours.pt")

    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)  # loads without trusting pickles
    assert_same(reference, ours)
    assert type(ours["pair"]) is tuple and isinstance(ours["layers"], list)


def test_round_trip_through_our_own_dcp(rich_pt: Path, tmp_path: Path) -> None:
    torch_save_to_dcp(rich_pt, tmp_path / "d")
    dcp_to_torch_save(tmp_path / "d", tmp_path / "back.pt")
    assert_same(rich_state_dict(), torch.load(tmp_path / "back.pt", weights_only=True))


def test_outputs_are_valid_zip_archives_with_correct_crcs(rich_pt: Path, tmp_path: Path) -> None:
    torch_save_to_dcp(rich_pt, tmp_path / "d")
    dcp_to_torch_save(tmp_path / "d", tmp_path / "back.pt")
    with zipfile.ZipFile(tmp_path / "back.pt") as zf:
        assert zf.testzip() is None
        names = zf.namelist()
    assert "back/data.pkl" in names and "back/byteorder" in names
    # data records are 64-byte aligned, as torch.load(mmap=True) expects
    loaded = torch.load(tmp_path / "back.pt", mmap=True, weights_only=True)
    assert_same(rich_state_dict(), loaded)


def test_legacy_torch_save_format(tmp_path: Path) -> None:
    sd = rich_state_dict()
    del sd["model"]["f8"], sd["model"]["u16"]  # not representable in the legacy format
    legacy = tmp_path / "legacy.pt"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    torch_save_to_dcp(legacy, tmp_path / "d")
    dcp_to_torch_save(tmp_path / "d", tmp_path / "back.pt")
    assert_same(sd, torch.load(tmp_path / "back.pt", weights_only=True))


def test_large_multi_tensor_checkpoint_streams_and_round_trips(tmp_path: Path) -> None:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    sd = llama_like_state_dict(24 << 20)
    torch.save(sd, tmp_path / "m.pt")
    seen: list[float] = []
    torch_save_to_dcp(tmp_path / "m.pt", tmp_path / "d", progress=lambda p: seen.append(p.fraction))
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) >= len(sd["model"])
    seen.clear()
    dcp_to_torch_save(tmp_path / "d", tmp_path / "back.pt", progress=lambda p: seen.append(p.fraction))
    assert seen[-1] == 1.0
    assert_same(sd, torch.load(tmp_path / "back.pt", weights_only=True))
