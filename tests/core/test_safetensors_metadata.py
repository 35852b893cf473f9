"""A safetensors source's own ``__metadata__`` (torchao's quantization records, transformers'
``format``) carried into every safetensors output -- re-saved, resharded, from a sharded folder --
with DCP Studio's keys beside it, never replacing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dcpstudio.core import convert

THEIRS = {"format": "mlx", "tensor_names": json.dumps(["w"]), "w": json.dumps({"_type": "Float8Tensor"})}


def _meta(path: Path) -> dict[str, str]:
    with safe_open(path, "pt") as f:
        meta: dict[str, str] = f.metadata() or {}
        assert "dcpstudio.manifest" in meta  # ours, beside theirs (tests/core/test_manifests.py)
        return {k: v for k, v in meta.items() if k != "dcpstudio.manifest"}


def _sharded(directory: Path, metas: list[dict[str, str]]) -> None:
    directory.mkdir()
    weight_map = {}
    for k, meta in enumerate(metas):
        name = f"model-{k + 1:05d}-of-{len(metas):05d}.safetensors"
        save_file({f"t{k}": torch.full((2,), float(k))}, directory / name, metadata=meta)
        weight_map[f"t{k}"] = name
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_resave_keeps_their_metadata_beside_ours(tmp_path: Path) -> None:
    save_file({"w": torch.ones(3)}, tmp_path / "a.safetensors", metadata=THEIRS)
    convert(tmp_path / "a.safetensors", tmp_path / "b.safetensors", to="safetensors")
    assert _meta(tmp_path / "b.safetensors") == THEIRS
    convert(tmp_path / "a.safetensors", tmp_path / "c", to="safetensors", max_shard_size=4)
    for shard in (tmp_path / "c").glob("*.safetensors"):
        assert _meta(shard) == THEIRS


def test_sharded_folder_metadata_carried_and_disagreement_said(tmp_path: Path) -> None:
    common = {"format": "pt", "quant": "torchao"}
    _sharded(tmp_path / "hf", [common, common])
    convert(tmp_path / "hf", tmp_path / "one.safetensors", to="safetensors")
    assert _meta(tmp_path / "one.safetensors") == common
    _sharded(tmp_path / "odd", [{"k": "1"}, {"k": "2"}])
    with pytest.warns(UserWarning, match="differ on k"):
        result = convert(tmp_path / "odd", tmp_path / "two.safetensors", to="safetensors")
    assert _meta(tmp_path / "two.safetensors")["k"] == "1" and any("differ on k" in n for n in result.notes)
