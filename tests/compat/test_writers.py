"""Checkpoints from the real writers (tests/compat/writers.py), through every operation, checked
against what torch's own reader of that format makes of them, bit for bit."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert, diff, open_checkpoint
from dcpstudio.core.ranks.load import run_load
from tests.compat import writers
from tests.conftest import assert_same

pytestmark = pytest.mark.filterwarnings("ignore")


def _every_tensor(path: Path, expected: dict[str, torch.Tensor]) -> None:
    with open_checkpoint(path) as ckpt:
        assert {k for k, e in ckpt.entries.items() if e.kind == "tensor"} == set(expected)
        for fqn, want in expected.items():
            got = ckpt.read_tensor(fqn)
            assert got.dtype == want.dtype and got.shape == want.shape, fqn
            assert torch.equal(got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), fqn
            if want.dim() and want.shape[0] >= 3:
                rows = ckpt.read_tensor(fqn, [slice(1, 3)])  # a region spanning shards
                assert torch.equal(rows, want[1:3]), fqn


def _through_every_format(path: Path, tmp: Path) -> None:
    """Converted to each format, and back, nothing changes (our verify, bit-exact)."""
    for target in ("dcp", "torch", "safetensors"):
        out = tmp / f"as_{target}"
        convert(path, out, to=target)  # type: ignore[arg-type]
        with open_checkpoint(path) as a, open_checkpoint(out) as b:
            report = diff(a, b)
            tensors = {k for k, e in a.entries.items() if e.kind == "tensor"}
            assert not (set(report.only_a) & tensors) and not report.values and not report.dtype, report


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.skipif(not writers.has("torch.distributed.fsdp", "fully_shard"), reason="no FSDP2 in this torch")
@pytest.mark.parametrize(("threads", "use_async"), [(2, True), (1, False)])
def test_fsdp2_with_adamw(tmp_path: Path, threads: int, use_async: bool) -> None:
    ckpt = writers.fsdp2_adamw(tmp_path / "fsdp", threads=threads, use_async=use_async)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    # DCP -> torch.save: deep-identical to torch's own converter
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(ckpt, tmp_path / "theirs.pt")
    convert(ckpt, tmp_path / "ours.pt", to="torch")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=False)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert_same(theirs, ours)
    flat = {k: v for k, v in _flat(reference).items() if isinstance(v, torch.Tensor)}
    _every_tensor(ckpt, {k: v for k, v in _flat(ours).items() if isinstance(v, torch.Tensor)})
    for name in ("model.0.weight", "model.2.bias"):
        assert torch.equal(_flat(ours)[name], flat[name])
    _through_every_format(ckpt, tmp_path)
    reports = run_load(ckpt, ranks=2, layout="fsdp", timeout=240)
    assert all(r.ok for r in reports), [r.mismatches for r in reports]


@pytest.mark.skipif(not writers.has("torch.distributed.checkpoint", "HuggingFaceStorageWriter"), reason="no HF writer")
@pytest.mark.parametrize("layout", ["distributed", "single"])
def test_huggingface_storage_writer(tmp_path: Path, layout: str) -> None:
    maker = writers.hf_distributed if layout == "distributed" else writers.hf_single
    ckpt = maker(tmp_path / "hf")
    theirs = writers.read_hf_with_torch(ckpt)
    for name, t in writers.full_tensors().items():
        assert torch.equal(theirs[name], t)  # torch's reader agrees with what was saved
    _every_tensor(ckpt, theirs)
    _through_every_format(ckpt, tmp_path)
    reports = run_load(ckpt, ranks=2, layout="shard0", timeout=240)
    assert all(r.ok for r in reports), [r.mismatches for r in reports]
    if layout == "distributed":  # one rank's file alone: its tensors are shards, placed where they belong
        lone = sorted(ckpt.glob("*.safetensors"))[1]
        with open_checkpoint(lone) as shard:
            entry = shard.entries["lm_head.weight"]
            assert entry.shard_of is not None and entry.shard_of[0] == (6, 0) and entry.shape == (5, 6)
            assert torch.equal(shard.read_tensor("lm_head.weight"), theirs["lm_head.weight"][6:])


@pytest.mark.skipif(not writers.has("torch.distributed.checkpoint.filesystem", "SerializationFormat"), reason="old")
def test_dcp_serialized_as_safetensors(tmp_path: Path) -> None:
    """torch's own dcp.load cannot read this layout; we read it against the state dict it saved."""
    ckpt = writers.safetensors_serialized_dcp(tmp_path / "stdcp")
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    _every_tensor(ckpt, {f"model.{k}": v for k, v in reference["model"].items()})
    convert(ckpt, tmp_path / "back.pt", to="torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same(reference, back)
    assert back["betas"] == (0.9, 0.95)
    _through_every_format(ckpt, tmp_path)


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_save_pretrained(tmp_path: Path, tied: bool) -> None:
    """transformers' sharded output (safetensors; .bin shards with pytorch_model.bin.index.json from
    4.x), when transformers is installed (it is not a test dependency)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = {k: v.detach() for k, v in model.state_dict().items()}
    layouts = [("safetensors", {})]
    if int(transformers.__version__.split(".")[0]) < 5:
        layouts.append(("bin", {"safe_serialization": False}))
    for name, options in layouts:
        out = tmp_path / name
        model.save_pretrained(out, max_shard_size="20KB", **options)
        with open_checkpoint(out) as ckpt:
            saved = {k for k, e in ckpt.entries.items() if e.kind == "tensor"}
            assert saved <= set(reference) and len(saved) >= len(reference) - 1  # a tied head is saved once
            for fqn in saved:
                assert torch.equal(ckpt.read_tensor(fqn), reference[fqn]), fqn
        (tmp_path / f"conv_{name}").mkdir()
        _through_every_format(out, tmp_path / f"conv_{name}")
