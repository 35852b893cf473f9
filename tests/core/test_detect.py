"""Formats are recognised by content, whatever the file is called."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dcpstudio.core import UnsupportedFormatError, convert, detect_format, open_checkpoint, torch_save_to_dcp


def test_detects_each_format_by_content(rich_pt: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "weights.safetensors"  # a torch.save file with a misleading name
    renamed.write_bytes(rich_pt.read_bytes())
    assert detect_format(renamed) == "torch"

    legacy = tmp_path / "legacy.bin"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert detect_format(legacy) == "torch"

    st = tmp_path / "model.pt"  # a safetensors file named like a torch.save file
    save_file({"w": torch.ones(2)}, st)
    assert detect_format(st) == "safetensors"

    torch_save_to_dcp(rich_pt, tmp_path / "d")
    assert detect_format(tmp_path / "d") == "dcp"


def test_safetensors_converts_to_dcp_by_default(tmp_path: Path) -> None:
    st = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, st)
    assert convert(st, tmp_path / "out").target == "dcp"
    assert detect_format(tmp_path / "out") == "dcp"
    # the same format is a re-save (entries dropped, floats cast, re-sharded), not an error
    assert convert(st, tmp_path / "again", to="safetensors", dtype="bf16").target == "safetensors"
    with open_checkpoint(tmp_path / "again") as again:
        assert again.entries["w"].dtype == torch.bfloat16


def test_plain_pickle_is_not_a_torch_save_file(tmp_path: Path) -> None:
    import pickle

    p = tmp_path / "x.pkl"
    p.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(UnsupportedFormatError, match=r"not a torch\.save file"):
        torch_save_to_dcp(p, tmp_path / "out")


def test_a_safetensors_header_that_begins_like_a_pickle_is_safetensors(tmp_path: Path) -> None:
    """A header of 640 bytes is length 80 02 00 ... -- the bytes a protocol-2 pickle begins with:
    content sniffing must not take it for a legacy torch.save file."""
    import json
    import struct

    body = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"pad": ""}}
    text = json.dumps(body)
    body["__metadata__"]["pad"] = "x" * (640 - len(text))
    header = json.dumps(body).encode()
    assert len(header) == 640
    (tmp_path / "w").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\x80?")
    assert detect_format(tmp_path / "w") == "safetensors"
    with open_checkpoint(tmp_path / "w") as ckpt:
        assert ckpt.read_tensor("w").tolist() == [1.0]
