"""Tiny torchtitan 0.3.0 models (Llama3, Qwen3, DeepSeek-V3) saved as torchtitan saves them: a
fixed-seed init, wrapped with FSDP2 ``fully_shard`` on 2 gloo ranks, ``dcp.save`` of the model
state dict (torchtitan's flat model names at the top level). Next to each checkpoint: the Hugging
Face ``config.json`` that torchtitan's ``convert_to_hf.py`` would take as ``hf_assets_path``, the
full state dict the ranks saved (``reference.pt``), and torchtitan's own adapter output
(``to_hf`` of that state dict) as a Hugging Face folder -- the ground truth a mapping must match.

The dims are tiny (2 layers, dim 64, GQA kv heads, 4 routed experts), and after the init the 1-D
weights (norms, router bias) are perturbed with a seeded generator: at init they are all ones or
zeros, so a swapped q/k norm or a dropped router bias would not change the logits.

Needs torchtitan==0.3.0 (its private config builders are used, pinned) and, for the Hugging Face
side, transformers. Rank workers run under dcpstudio.core.ranks.launch (spawned, gloo).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODELS = ("llama3", "qwen3", "deepseek_v3")
MAPPINGS = {name: f"torchtitan-{name}" for name in MODELS}
DIM, VOCAB, LAYERS, HEADS, KV_HEADS, HIDDEN = 64, 128, 2, 4, 2, 96
EXPERTS, TOP_K, MOE_HIDDEN = 4, 2, 32
SEED = 1234


def _llama3() -> Any:
    from torchtitan.models import llama3 as m
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama")
    return m.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._output_linear_init(DIM)),
        layers=m._build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN, rope=rope,
            attn_backend="flex",
        ),
    )  # fmt: skip


def _qwen3() -> Any:
    """Tied embeddings (as Qwen3-0.6B), head_dim 32 != dim / heads, q/k norms."""
    from torchtitan.models import qwen3 as m
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    return m.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=m._qwen3_norm(DIM),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._LINEAR_INIT),
        layers=m._build_qwen3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=32, hidden_dim=HIDDEN,
            attn_backend="flex", rope=CosSinRoPE.Config(dim=32, max_seq_len=64, theta=1000000.0),
        ),
    )  # fmt: skip


def _deepseek_v3() -> Any:
    """MLA without q LoRA, one dense layer then one MoE layer (4 experts, 1 shared, sigmoid router
    with a correction bias, as Hugging Face's DeepseekV3 routes)."""
    from torchtitan.models import deepseek_v3 as m
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    layers = m._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=HIDDEN,
        moe_hidden_dim=MOE_HIDDEN, num_experts=EXPERTS, num_shared_experts=1, router_top_k=TOP_K,
        router_score_func="sigmoid", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0),
    )  # fmt: skip
    return m.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._output_linear_init(DIM)),
        layers=layers,
        mtp_layers=[],
    )


_COMMON = {"vocab_size": VOCAB, "hidden_size": DIM, "num_hidden_layers": LAYERS, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 64, "dtype": "float32", "attention_bias": False}  # fmt: skip
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3": {
        **_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": DIM // HEADS, "intermediate_size": HIDDEN,
        "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 16384,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "qwen3": {
        **_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": 32, "intermediate_size": HIDDEN, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rope_scaling": None,
        "use_sliding_window": False,
    },
    "deepseek_v3": {
        **_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "intermediate_size": HIDDEN,
        "moe_intermediate_size": MOE_HIDDEN, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "hidden_act": "silu",
        "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True, "tie_word_embeddings": False,
    },
}  # fmt: skip
_BUILDERS = {"llama3": _llama3, "qwen3": _qwen3, "deepseek_v3": _deepseek_v3}


def titan_config(name: str) -> Any:
    return _BUILDERS[name]()


def adapter(name: str) -> Any:
    """torchtitan's own StateDictAdapter for ``name`` (offline: no hf_assets_path)."""
    import importlib

    module = importlib.import_module(f"torchtitan.models.{name}")
    cls = {"llama3": "Llama3StateDictAdapter", "qwen3": "Qwen3StateDictAdapter",
           "deepseek_v3": "DeepSeekV3StateDictAdapter"}[name]  # fmt: skip
    return getattr(module, cls)(titan_config(name), None)


def build_model(name: str) -> torch.nn.Module:
    """The model at step 0: seeded init, then the 1-D weights perturbed (see the module docstring)."""
    torch.manual_seed(SEED)
    model = titan_config(name).build()
    model.init_states()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for fqn, t in sorted(model.state_dict().items()):
            if t.dim() == 1 and t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * (0.1 if fqn.endswith("weight") else 0.5))
    return model


@contextlib.contextmanager
def eager_attention() -> Iterator[None]:
    """FlexAttention and its block mask without torch.compile: on CPU, inductor compiles them for
    ~20 s per model; eager, they compute the same attention (max difference 2e-7 on llama3)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    saved = attention.FlexAttention.__dict__["_compiled_flex_attn"], attention._compiled_create_block_mask
    attention.FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    attention._compiled_create_block_mask = create_block_mask
    try:
        yield
    finally:
        attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask = saved


def titan_logits(name: str, state_dict: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The torchtitan model's forward (float32, CPU, no grad) with ``state_dict`` loaded."""
    torch.manual_seed(0)
    model = titan_config(name).build()
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad(), eager_attention():
        return model(ids, positions, model.get_attention_masks(positions))


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """What ``transformers`` computes from a Hugging Face folder (float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def fixed_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _save_worker(rank: int, world: int, report: Any, names: list[str], root: str) -> None:
    """Each model of ``names`` into ``root/NAME/dcp``, in one process group (one spawn for all)."""
    for name in names:
        _save_one(rank, name, str(Path(root) / name / "dcp"))


def _save_one(rank: int, name: str, out: str) -> None:
    """Every rank builds the same model, shards it with FSDP2 and saves it through torchtitan's
    own ``ModelWrapper`` (its checkpointer's view: flat names, fused QKV split by the module's
    state-dict hook); rank 0 also writes the full tensors the ranks saved (gathered, not rebuilt)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpointer.base import ModelWrapper

    model = build_model(name)
    for layer in model.layers.values():  # type: ignore[operator]
        fully_shard(layer)
    fully_shard(model)
    state = ModelWrapper(model).state_dict()
    dcp.save(state, checkpoint_id=out)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    if rank == 0:
        torch.save(full, Path(out).with_name("reference.pt"))
    dist.barrier()


@dataclass(frozen=True)
class Produced:
    name: str
    mapping: str
    dcp: Path  # the FSDP2 checkpoint (torchtitan names)
    config: Path  # the Hugging Face config.json
    assets: Path  # a folder holding config.json, as torchtitan's hf_assets_path
    adapter_hf: Path  # torchtitan's to_hf output + config.json: a folder transformers loads
    reference: Path  # the full state dict saved (torchtitan names)

    def reference_state_dict(self) -> dict[str, torch.Tensor]:
        return torch.load(self.reference, weights_only=True)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.adapter_hf / "model.safetensors"))


def produce(names: tuple[str, ...], root: Path, timeout: float = 300.0) -> dict[str, Produced]:
    """Write each model's checkpoint, config and torchtitan's adapter output under ``root/NAME``."""
    from safetensors.torch import save_file

    from dcpstudio.core.ranks.launch import launch

    launch(_save_worker, (list(names), str(root)), nprocs=2, timeout=timeout)
    made = {}
    for name in names:
        where = root / name
        assets = where / "assets"
        assets.mkdir()
        (assets / "config.json").write_text(json.dumps(HF_CONFIGS[name], indent=2))
        reference = where / "reference.pt"
        hf = adapter(name).to_hf(dict(torch.load(reference, weights_only=True)))
        adapter_hf = where / "adapter_hf"
        adapter_hf.mkdir()
        save_file({k: v.contiguous() for k, v in hf.items()}, str(adapter_hf / "model.safetensors"), {"format": "pt"})
        (adapter_hf / "config.json").write_text((assets / "config.json").read_text())
        config = assets / "config.json"
        made[name] = Produced(name, MAPPINGS[name], where / "dcp", config, assets, adapter_hf, reference)
    return made
