"""The mapping engine on a generated llama-like torchtitan checkpoint (no torchtitan needed):
the Hugging Face output against a reference written here from torchtitan's ``_permute``, the
round trip back bit for bit, verify through the mapping, the dry run, the refusals, a TOML rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dcpstudio.cli.main import main
from tests.conftest import dcp_load, dcp_save

DIM, HEADS, KV, LAYERS, VOCAB, FFN = 32, 4, 2, 2, 40, 48
HEAD_DIM = DIM // HEADS
CONFIG = {
    "hidden_size": DIM,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB,
    "intermediate_size": FFN,
    "tie_word_embeddings": False,
}


def _titan(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    sd = {"tok_embeddings.weight": w(VOCAB, DIM), "norm.weight": w(DIM), "lm_head.weight": w(VOCAB, DIM)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd |= {
            p + "attention.qkv_linear.wq.weight": w(HEADS * HEAD_DIM, DIM),
            p + "attention.qkv_linear.wk.weight": w(KV * HEAD_DIM, DIM),
            p + "attention.qkv_linear.wv.weight": w(KV * HEAD_DIM, DIM),
            p + "attention.wo.weight": w(DIM, HEADS * HEAD_DIM),
            p + "feed_forward.w1.weight": w(FFN, DIM),
            p + "feed_forward.w3.weight": w(FFN, DIM),
            p + "feed_forward.w2.weight": w(DIM, FFN),
            p + "attention_norm.weight": w(DIM),
            p + "ffn_norm.weight": w(DIM),
        }
    return sd


def _permute(w: torch.Tensor, n_heads: int, dim1: int, dim2: int) -> torch.Tensor:
    """torchtitan 0.3.0 ``Llama3StateDictAdapter._permute``, as written there."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2).clone()


def _reference_hf(sd: dict[str, torch.Tensor], tied: bool = False) -> dict[str, torch.Tensor]:
    names = {
        "attention.qkv_linear.wq": "self_attn.q_proj",
        "attention.qkv_linear.wk": "self_attn.k_proj",
        "attention.qkv_linear.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not tied:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(LAYERS):
        for titan, hf in names.items():
            value = sd[f"layers.{i}.{titan}.weight"]
            if titan.endswith("wq"):
                value = _permute(value, HEADS, HEADS * HEAD_DIM, DIM)
            elif titan.endswith("wk"):
                value = _permute(value, KV, KV * HEAD_DIM, DIM)
            out[f"model.layers.{i}.{hf}.weight"] = value
    return out


def _write(tmp: Path, sd: dict[str, Any], config: dict[str, Any] | None = None) -> tuple[Path, Path]:
    src = tmp / "titan"
    dcp_save(sd, checkpoint_id=str(src))
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps(config or CONFIG))
    return src, cfg


def _run(*argv: str) -> int:
    return main(list(argv))


def test_to_hf_matches_reference_and_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = _titan()
    src, cfg = _write(tmp_path, sd)
    hf = tmp_path / "hf"
    assert _run("convert", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg), "-q") == 0
    got = load_file(str(hf / "model.safetensors"))
    want = _reference_hf(sd)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert json.loads((hf / "config.json").read_text()) == CONFIG
    assert _run("verify", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg)) == 0
    assert "through torchtitan-llama3" in capsys.readouterr().out
    back = tmp_path / "back"
    assert _run("convert", str(hf), str(back), "--mapping", "torchtitan-llama3", "--config", str(cfg), "-q") == 0
    loaded = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp_load(loaded, checkpoint_id=str(back))
    for name, value in sd.items():
        assert torch.equal(loaded[name], value), name


def test_verify_through_mapping_finds_a_changed_tensor(tmp_path: Path) -> None:
    sd = _titan()
    src, cfg = _write(tmp_path, sd)
    hf = tmp_path / "hf"
    assert _run("convert", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg), "-q") == 0
    other = tmp_path / "other"
    wrong = {k: v for k, v in sd.items()}
    wrong["layers.1.attention.qkv_linear.wk.weight"] = sd["layers.1.attention.qkv_linear.wk.weight"].flip(0)
    dcp_save(wrong, checkpoint_id=str(other))
    assert _run("verify", str(other), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg)) == 1


def test_tied_training_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd: dict[str, Any] = _titan()
    sd["lm_head.weight"] = sd["tok_embeddings.weight"]
    train = {**sd, "optimizer": {"state": {"norm.weight": {"exp_avg": torch.zeros(DIM)}}}, "train_state": {"step": 3}}
    src, cfg = _write(tmp_path, train, {**CONFIG, "tie_word_embeddings": True})
    hf = tmp_path / "hf"
    assert _run("convert", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg)) == 0
    out = capsys.readouterr().out
    assert "left out 2 training state entries" in out
    got = load_file(str(hf / "model.safetensors"))
    assert "lm_head.weight" not in got
    assert sorted(got) == sorted(_reference_hf(sd, tied=True))
    back = tmp_path / "back"
    assert _run("convert", str(hf), str(back), "--mapping", "torchtitan-llama3", "--config", str(cfg), "-q") == 0
    loaded = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp_load(loaded, checkpoint_id=str(back))
    assert torch.equal(loaded["lm_head.weight"], sd["tok_embeddings.weight"])


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, cfg = _write(tmp_path, _titan())
    hf = tmp_path / "hf"
    argv = ("convert", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg), "--dry-run")
    assert _run(*argv) == 0
    out = capsys.readouterr().out
    assert "torchtitan -> hf names, 21 entries" in out
    line = "layers.0.attention.qkv_linear.wk.weight -> permute(heads=2) -> model.layers.0.self_attn.k_proj.weight"
    assert f"{line} [16, 32] bfloat16" in out
    assert not hf.exists()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"extra": "stray.weight"}, "1 entries match no rule of torchtitan-llama3: stray.weight"),
        (
            {"num_key_value_heads": 4},
            "layers.0.attention.qkv_linear.wk.weight has shape [16, 32], the config implies [32, 32]",
        ),
        ({"num_hidden_layers": 3}, "entries the config implies are missing: layers.2.attention.qkv_linear.wq.weight"),
        ({"num_attention_heads": 3}, "the config implies"),
    ],
)
def test_refused_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any], words: str
) -> None:
    sd: dict[str, Any] = _titan()
    if "extra" in change:
        sd[change.pop("extra")] = torch.zeros(3)
    src, cfg = _write(tmp_path, sd, {**CONFIG, **change})
    hf = tmp_path / "hf"
    assert _run("convert", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg)) == 1
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert not hf.exists()


def test_allow_unmapped_passes_through(tmp_path: Path) -> None:
    sd: dict[str, Any] = _titan()
    sd["stray.weight"] = torch.arange(3.0)
    src, cfg = _write(tmp_path, sd)
    hf = tmp_path / "hf"
    argv = ("convert", str(src), str(hf), "--mapping", "torchtitan-llama3", "--config", str(cfg), "-q")
    assert _run(*argv, "--allow-unmapped") == 0
    assert torch.equal(load_file(str(hf / "model.safetensors"))["stray.weight"], torch.arange(3.0))


def test_mapping_flags_need_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("convert", "a", "b", "--mapping", "torchtitan-llama3") == 2
    assert "--mapping needs --config" in capsys.readouterr().err
    assert _run("convert", "a", "b", "--dry-run") == 2
    assert _run("mappings") == 0
    assert "torchtitan-llama3" in capsys.readouterr().out


_TOML = """
[mapping]
name = "fused"
sides = ["mine", "theirs"]

[defaults]
half = "width // 2"

[[rule]]
src = "blocks.{layer}.qk"
dst = ["b.{layer}.q", "b.{layer}.k"]
shape = ["width", 3]
ops = [{op = "split", dim = 0, sizes = ["half", "width - half"]}, "transpose"]

[[rule]]
src = "blocks.{layer}.experts.{expert}"
dst = "b.{layer}.grouped"
ops = [{op = "stack", count = "experts"}]
"""


def test_toml_custom_rules(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    sd = {"blocks.0.qk": torch.randn(6, 3, generator=g)}
    sd |= {f"blocks.0.experts.{e}": torch.randn(2, 3, generator=g) for e in range(4)}
    src, cfg = _write(tmp_path, sd, {"width": 6, "experts": 4})
    rules = tmp_path / "rules.toml"
    rules.write_text(_TOML)
    out = tmp_path / "out.safetensors"
    assert _run("convert", str(src), str(out), "--mapping", str(rules), "--config", str(cfg), "-q") == 0
    got = load_file(str(out))
    assert torch.equal(got["b.0.q"], sd["blocks.0.qk"][:3].T) and torch.equal(got["b.0.k"], sd["blocks.0.qk"][3:].T)
    assert torch.equal(got["b.0.grouped"], torch.stack([sd[f"blocks.0.experts.{e}"] for e in range(4)]))
    back = tmp_path / "back"
    assert _run("convert", str(out), str(back), "--mapping", str(rules), "--config", str(cfg), "-q") == 0
    loaded = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp_load(loaded, checkpoint_id=str(back))
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_qwen3_moe_experts_unstacked_and_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(2)
    cfg = {**CONFIG, "num_experts": 3, "moe_intermediate_size": 8, "head_dim": HEAD_DIM, "num_hidden_layers": 1}
    p = "layers.0."
    sd = {k: v for k, v in _titan().items() if k.startswith(("tok_", "norm", "lm_head", p)) and "feed_forward" not in k}
    sd |= {p + "attention.q_norm.weight": torch.randn(HEAD_DIM, generator=g),
           p + "attention.k_norm.weight": torch.randn(HEAD_DIM, generator=g),
           p + "moe.router.gate.weight": torch.randn(3, DIM, generator=g),
           p + "moe.routed_experts.inner_experts.w1_EFD": torch.randn(3, 8, DIM, generator=g),
           p + "moe.routed_experts.inner_experts.w3_EFD": torch.randn(3, 8, DIM, generator=g),
           p + "moe.routed_experts.inner_experts.w2_EDF": torch.randn(3, DIM, 8, generator=g)}  # fmt: skip
    src, config = _write(tmp_path, sd, cfg)
    hf = tmp_path / "hf"
    assert _run("convert", str(src), str(hf), "--mapping", "torchtitan-qwen3", "--config", str(config), "-q") == 0
    got = load_file(str(hf / "model.safetensors"))
    w2 = sd[p + "moe.routed_experts.inner_experts.w2_EDF"]
    assert all(torch.equal(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], w2[e]) for e in range(3))
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], sd[p + "attention.qkv_linear.wq.weight"])
    back = tmp_path / "back"
    assert _run("convert", str(hf), str(back), "--mapping", "torchtitan-qwen3", "--config", str(config), "-q") == 0
    loaded = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp_load(loaded, checkpoint_id=str(back))
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    (hf / "model.safetensors").unlink()  # an expert missing from the Hugging Face side is refused
    from safetensors.torch import save_file

    save_file({k: v for k, v in got.items() if ".experts.2." not in k}, str(hf / "model.safetensors"))
    (hf / "model.safetensors.index.json").unlink()
    assert (
        _run("convert", str(hf), str(tmp_path / "again"), "--mapping", "torchtitan-qwen3", "--config", str(config)) == 1
    )
    assert "missing: model.layers.0.mlp.experts.2.gate_proj.weight" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_row_order_is_the_permutation_torch_makes() -> None:
    """Written outputs that only reorder rows are gathered from bytes without torch
    (``row_order``); the order must be exactly what the torch operations make, chains included,
    and anything else is left to torch."""
    from dcpstudio.core.ops.mappings.tensor_ops import Op, apply_ops, row_order

    w = torch.arange(48 * 3).reshape(48, 3)
    for ops in (
        [Op("permute", {"heads": 4})],
        [Op("unpermute", {"heads": 3})],
        [Op("permute", {"heads": 2}), Op("permute", {"heads": 6})],
    ):
        order = row_order(ops, 48)
        assert order is not None and torch.equal(w[order], apply_ops([w], ops)[0])
    assert row_order([Op("permute", {"heads": 4}), Op("transpose", {})], 48) is None
