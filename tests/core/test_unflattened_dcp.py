"""DCPs saved with ``DefaultSavePlanner(flatten_state_dict=False)``: each top-level value, a nested
dict of tensors included, is one byte item. Its entries are found and converted (torch's
``dcp_to_torch_save`` is the ground truth: the nested dict), and a value holding tensors is never
left out of a safetensors output as a 'non-JSON value': the conversion refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dcpstudio.core import convert, diff, open_checkpoint
from dcpstudio.core.errors import UnsafePickleError, UnsupportedFormatError
from tests.conftest import assert_same, dcp_load, dcp_save


def _state() -> dict[str, Any]:
    return {
        "model": {"a": torch.arange(6.0).reshape(2, 3), "sub": {"b": torch.ones(4, dtype=torch.bfloat16)}, "n": 3},
        "step": 7,
    }


@pytest.fixture
def unflattened(tmp_path: Path) -> Path:
    dcp_save(_state(), checkpoint_id=tmp_path / "nf", planner=DefaultSavePlanner(flatten_state_dict=False))
    return tmp_path / "nf"


def test_nested_entries_found_by_dotted_name(unflattened: Path) -> None:
    with open_checkpoint(unflattened) as ckpt:
        assert list(ckpt.entries) == ["model.a", "model.sub.b", "model.n", "step"]
        assert ckpt.paths()["model.sub.b"] == ("model", "sub", "b")
        assert torch.equal(ckpt.read_tensor("model.a", [slice(1, 2)]), _state()["model"]["a"][1:2])
        assert set(ckpt.tree.children["model"].children) == {"a", "sub", "n"}


def test_converted_as_torch_reads_it(unflattened: Path, tmp_path: Path) -> None:
    dcp_to_torch_save(unflattened, tmp_path / "truth.pt")
    truth = torch.load(tmp_path / "truth.pt", weights_only=False)
    convert(unflattened, tmp_path / "out.pt", to="torch")
    assert_same(torch.load(tmp_path / "out.pt", weights_only=True), truth)
    convert(unflattened, tmp_path / "out", to="dcp")
    target = {"model": {"a": torch.empty(2, 3), "sub": {"b": torch.empty(4, dtype=torch.bfloat16)}, "n": 0}, "step": 0}
    dcp_load(target, checkpoint_id=tmp_path / "out")
    assert_same(target, truth)
    convert(unflattened, tmp_path / "out.safetensors", to="safetensors")
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.sub.b"), truth["model"]["sub"]["b"])
    for out in ("out.pt", "out", "out.safetensors"):
        with open_checkpoint(unflattened) as a, open_checkpoint(tmp_path / out) as b:
            assert diff(a, b).equal


def test_a_value_holding_tensors_is_refused_not_dropped(tmp_path: Path) -> None:
    dcp_save({"pair": (torch.ones(2), torch.zeros(2)), "w": torch.ones(3)}, checkpoint_id=tmp_path / "t")
    with pytest.raises(UnsupportedFormatError, match="'pair' is a tuple value holding 2 tensor"):
        convert(tmp_path / "t", tmp_path / "t.safetensors", to="safetensors")
    assert not (tmp_path / "t.safetensors").exists()


def test_an_unsafe_item_still_opens_and_refuses_its_value(tmp_path: Path) -> None:
    dcp_save(
        {"model": {"w": torch.ones(2)}, "odd": {"f": Path("x")}},
        checkpoint_id=tmp_path / "u",
        planner=DefaultSavePlanner(flatten_state_dict=False),
    )
    with open_checkpoint(tmp_path / "u") as ckpt:
        assert list(ckpt.entries) == ["model.w", "odd"]
        with pytest.raises(UnsafePickleError):
            ckpt.read_object("odd")
