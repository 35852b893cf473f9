"""Layouts and conversions users meet beyond the three plain formats: torch.save shards with an
index, re-saving in the same format (resharded, cast, subset), destinations that are directories,
Python types in safetensors values, non-tensor NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from dcpstudio.core import convert, detect_format, diff, open_checkpoint
from tests.conftest import assert_same, dcp_load, rich_state_dict


def _bin_shards(directory: Path) -> dict[str, torch.Tensor]:
    """What transformers writes for a large model: pytorch_model-0000N-of-0000M.bin + index."""
    g = torch.Generator().manual_seed(5)
    tensors = {f"model.layers.{i}.weight": torch.randn(4, 3, generator=g) for i in range(5)}
    tensors["lm_head.weight"] = tensors["model.layers.0.weight"]  # tied, across files
    directory.mkdir()
    names = list(tensors)
    weight_map = {}
    for k, chunk in enumerate((names[:3], names[3:])):
        file = f"pytorch_model-{k + 1:05d}-of-00002.bin"
        torch.save({n: tensors[n] for n in chunk}, directory / file)
        weight_map.update(dict.fromkeys(chunk, file))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_torch_save_shards_with_an_index(tmp_path: Path) -> None:
    tensors = _bin_shards(tmp_path / "bin")
    for path in (tmp_path / "bin", tmp_path / "bin" / "pytorch_model.bin.index.json"):
        assert detect_format(path) == "torch"
        with open_checkpoint(path) as ckpt:
            assert set(ckpt.entries) == set(tensors)
            for name, t in tensors.items():
                assert torch.equal(ckpt.read_tensor(name), t)
    for target in ("dcp", "torch", "safetensors"):
        convert(tmp_path / "bin", tmp_path / f"out_{target}", to=target)  # type: ignore[arg-type]
        with open_checkpoint(tmp_path / "bin") as a, open_checkpoint(tmp_path / f"out_{target}") as b:
            assert diff(a, b).equal


def test_dcp_resharded_into_files_and_sizes(rich_pt: Path, tmp_path: Path) -> None:
    convert(rich_pt, tmp_path / "one", to="dcp")
    convert(tmp_path / "one", tmp_path / "three", to="dcp", files=3)
    assert len(list((tmp_path / "three").glob("*.distcp"))) == 3
    convert(tmp_path / "one", tmp_path / "small", to="dcp", max_file_size=400)
    files = sorted((tmp_path / "small").glob("*.distcp"))
    assert len(files) > 3
    for directory in ("three", "small"):
        with open_checkpoint(tmp_path / "one") as a, open_checkpoint(tmp_path / directory) as b:
            assert diff(a, b).equal
        target = {"model": {"w": torch.empty(6, 8)}, "step": 0}
        dcp_load(target, checkpoint_id=tmp_path / directory)  # torch's own reader follows the files
        assert torch.equal(target["model"]["w"], rich_state_dict()["model"]["w"]) and target["step"] == 12


def test_same_format_resaves(rich_pt: Path, tmp_path: Path) -> None:
    convert(rich_pt, tmp_path / "subset.pt", to="torch", include=r"^model\.(w|bf16)$", dtype="fp16")
    subset = torch.load(tmp_path / "subset.pt", weights_only=True)
    assert set(subset["model"]) == {"w", "bf16"} and subset["model"]["w"].dtype == torch.float16
    convert(rich_pt, tmp_path / "st", to="safetensors", max_shard_size=200, exclude="c64")
    convert(tmp_path / "st", tmp_path / "st2", to="safetensors", max_shard_size="1MB", strip_prefix="model.")
    with safe_open(str(tmp_path / "st2" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "w" in names and "model.w" not in names


def test_a_trailing_slash_means_a_directory(rich_pt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out" / "dir"
    (tmp_path / "out").mkdir()
    convert(rich_pt, f"{dst}/", to="safetensors", exclude="c64")
    assert dst.is_dir() and (dst / "model.safetensors").is_file() and (dst / "model.safetensors.index.json").is_file()


def test_python_types_survive_safetensors(rich_pt: Path, tmp_path: Path) -> None:
    """AdamW's betas stay a tuple; int dict keys and NaN come back too."""
    groups = ({0: "a", 1: [1, 2]},)  # a tuple is one value to DCP: the dict inside keeps its int keys
    torch.save({"w": torch.ones(2), "betas": (0.9, 0.999), "groups": groups, "x": math.nan}, rich_pt)
    convert(rich_pt, tmp_path / "v.safetensors", to="safetensors")
    convert(tmp_path / "v.safetensors", tmp_path / "v_dcp", to="dcp")
    target = {"w": torch.empty(2), "betas": None, "groups": None, "x": None}
    dcp_load(target, checkpoint_id=tmp_path / "v_dcp")
    assert target["betas"] == (0.9, 0.999) and target["groups"] == groups and math.isnan(target["x"])
    with open_checkpoint(rich_pt) as a, open_checkpoint(tmp_path / "v.safetensors") as b:
        assert diff(a, b).equal


def test_verify_a_nan_value_against_itself(tmp_path: Path) -> None:
    torch.save({"loss": math.nan, "w": torch.tensor([math.nan, 1.0])}, tmp_path / "nan.pt")
    with open_checkpoint(tmp_path / "nan.pt") as a, open_checkpoint(tmp_path / "nan.pt") as b:
        assert diff(a, b).equal
    assert_same({"k": 1}, {"k": 1})
