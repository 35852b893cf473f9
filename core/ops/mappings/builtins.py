"""The built-in mappings, as tables in the rule language (:mod:`.rules`) -- the same form a
user's TOML file takes -- written from torchtitan 0.3.0's ``models/*/state_dict_adapter.py``
(``to_hf``; ``from_hf`` is their inverse), which is not a dependency.

- ``torchtitan-llama3``: renames, the rotary q/k permutation (torchtitan's ``_permute`` with
  ``n_heads`` for q and ``n_kv_heads`` for k), the tied ``lm_head`` dropped / restored as a
  copy of the embedding (``tie_word_embeddings``), HF's ``rotary_emb.inv_freq`` dropped.
- ``torchtitan-qwen3``: renames (Qwen3's RoPE needs no permutation), q/k norms, and MoE layers:
  grouped experts (``w1_EFD``, ``w3_EFD``, ``w2_EDF``) unstacked into one tensor per expert and
  back, the router gate.
- ``torchtitan-deepseek_v3``: MLA attention (q_lora or plain q), dense layers before
  ``first_k_dense_replace`` and MoE after: grouped experts, shared experts, the router gate and
  its ``e_score_correction_bias``.
"""

from __future__ import annotations

from typing import Any

from .rules import Mapping, parse_mapping

__all__ = ["BUILTINS", "builtin"]

_TRAINING = ["^optimizer(\\.|$)", "^lr_scheduler(\\.|$)", "^dataloader(\\.|$)", "^train_state(\\.|$)"]
_HEAD = {"sides": ["torchtitan", "hf"], "ignore": _TRAINING, "drop": ["\\.rotary_emb\\.inv_freq$"]}
_DEFAULTS = {
    "num_key_value_heads": "num_attention_heads",
    "head_dim": "hidden_size // num_attention_heads",
    "tie_word_embeddings": 0,
}
_Q, _KV = "num_attention_heads * head_dim", "num_key_value_heads * head_dim"
_L, _H = "layers.{layer}.", "model.layers.{layer}."


def _r(src: str, dst: str, shape: list[Any] | None = None, **more: Any) -> dict[str, Any]:
    return {"src": src, "dst": dst, **({"shape": shape} if shape is not None else {}), **more}


def _ends(vocab: str = "vocab_size") -> list[dict[str, Any]]:
    """Embedding, final norm, lm_head (tied or not)."""
    return [
        _r("tok_embeddings.weight", "model.embed_tokens.weight", [vocab, "hidden_size"]),
        _r("norm.weight", "model.norm.weight", ["hidden_size"]),
        _r("lm_head.weight", "lm_head.weight", [vocab, "hidden_size"], when="not tie_word_embeddings"),
        {
            "src": "lm_head.weight",
            "tie": "model.embed_tokens.weight",
            "shape": [vocab, "hidden_size"],
            "when": "tie_word_embeddings",
        },
    ]


def _norms() -> list[dict[str, Any]]:
    return [
        _r(_L + "attention_norm.weight", _H + "input_layernorm.weight", ["hidden_size"]),
        _r(_L + "ffn_norm.weight", _H + "post_attention_layernorm.weight", ["hidden_size"]),
    ]


def _mlp(prefix: str, size: str, where: str | None = None, hf: str = "mlp.") -> list[dict[str, Any]]:
    more = {"where": where} if where else {}
    return [
        _r(_L + prefix + "w1.weight", _H + hf + "gate_proj.weight", [size, "hidden_size"], **more),
        _r(_L + prefix + "w3.weight", _H + hf + "up_proj.weight", [size, "hidden_size"], **more),
        _r(_L + prefix + "w2.weight", _H + hf + "down_proj.weight", ["hidden_size", size], **more),
    ]


def _experts(count: str, size: str, where: str) -> list[dict[str, Any]]:
    """Grouped experts (E, F, D) / (E, D, F) <-> one (F, D) / (D, F) tensor per expert."""
    grouped, each = _L + "moe.routed_experts.inner_experts.", _H + "mlp.experts.{expert}."
    unstack = [{"op": "unstack", "count": count}]
    return [
        _r(grouped + "w1_EFD", each + "gate_proj.weight", [count, size, "hidden_size"], ops=unstack, where=where),
        _r(grouped + "w3_EFD", each + "up_proj.weight", [count, size, "hidden_size"], ops=unstack, where=where),
        _r(grouped + "w2_EDF", each + "down_proj.weight", [count, "hidden_size", size], ops=unstack, where=where),
        _r(_L + "moe.router.gate.weight", _H + "mlp.gate.weight", [count, "hidden_size"], where=where),
    ]


_LLAMA3: dict[str, Any] = {
    "mapping": {
        "name": "torchtitan-llama3",
        "description": "torchtitan Llama 3 <-> Hugging Face LlamaForCausalLM",
        **_HEAD,
    },
    "defaults": _DEFAULTS,
    "ranges": {"layer": "num_hidden_layers"},
    "rule": [
        *_ends(),
        _r(
            _L + "attention.qkv_linear.wq.weight",
            _H + "self_attn.q_proj.weight",
            [_Q, "hidden_size"],
            ops=[{"op": "permute", "heads": "num_attention_heads"}],
        ),
        _r(
            _L + "attention.qkv_linear.wk.weight",
            _H + "self_attn.k_proj.weight",
            [_KV, "hidden_size"],
            ops=[{"op": "permute", "heads": "num_key_value_heads"}],
        ),
        _r(_L + "attention.qkv_linear.wv.weight", _H + "self_attn.v_proj.weight", [_KV, "hidden_size"]),
        _r(_L + "attention.wo.weight", _H + "self_attn.o_proj.weight", ["hidden_size", _Q]),
        *_norms(),
        *_mlp("feed_forward.", "intermediate_size"),
    ],
}

_QWEN3_MOE = "num_experts > 0 and (layer + 1) % decoder_sparse_step == 0"
_QWEN3: dict[str, Any] = {
    "mapping": {
        "name": "torchtitan-qwen3",
        "description": "torchtitan Qwen3 (dense and MoE) <-> Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM",
        **_HEAD,
    },
    "defaults": {**_DEFAULTS, "num_experts": 0, "decoder_sparse_step": 1, "moe_intermediate_size": 0},
    "ranges": {"layer": "num_hidden_layers"},
    "rule": [
        *_ends(),
        _r(_L + "attention.qkv_linear.wq.weight", _H + "self_attn.q_proj.weight", [_Q, "hidden_size"]),
        _r(_L + "attention.qkv_linear.wk.weight", _H + "self_attn.k_proj.weight", [_KV, "hidden_size"]),
        _r(_L + "attention.qkv_linear.wv.weight", _H + "self_attn.v_proj.weight", [_KV, "hidden_size"]),
        _r(_L + "attention.wo.weight", _H + "self_attn.o_proj.weight", ["hidden_size", _Q]),
        _r(_L + "attention.q_norm.weight", _H + "self_attn.q_norm.weight", ["head_dim"]),
        _r(_L + "attention.k_norm.weight", _H + "self_attn.k_norm.weight", ["head_dim"]),
        *_norms(),
        *_mlp("feed_forward.", "intermediate_size", f"not ({_QWEN3_MOE})"),
        *_experts("num_experts", "moe_intermediate_size", _QWEN3_MOE),
    ],
}

_DSV3_MOE = "layer >= first_k_dense_replace"
_DSV3: dict[str, Any] = {
    "mapping": {
        "name": "torchtitan-deepseek_v3",
        "description": "torchtitan DeepSeek-V3 <-> Hugging Face "
        "DeepseekV3ForCausalLM (bf16/fp32 weights; fp8 sources: dequantise first)",
        **_HEAD,
    },
    "defaults": {
        "first_k_dense_replace": 0,
        "n_shared_experts": 1,
        "q_lora_rank": 0,
        "tie_word_embeddings": 0,
        "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim",
    },
    "ranges": {"layer": "num_hidden_layers"},
    "rule": [
        *_ends(),
        _r(
            _L + "attention.wq.weight",
            _H + "self_attn.q_proj.weight",
            ["num_attention_heads * qk_head_dim", "hidden_size"],
            when="not q_lora_rank",
        ),
        _r(
            _L + "attention.wq_a.weight",
            _H + "self_attn.q_a_proj.weight",
            ["q_lora_rank", "hidden_size"],
            when="q_lora_rank",
        ),
        _r(_L + "attention.q_norm.weight", _H + "self_attn.q_a_layernorm.weight", ["q_lora_rank"], when="q_lora_rank"),
        _r(
            _L + "attention.wq_b.weight",
            _H + "self_attn.q_b_proj.weight",
            ["num_attention_heads * qk_head_dim", "q_lora_rank"],
            when="q_lora_rank",
        ),
        _r(
            _L + "attention.wkv_a.weight",
            _H + "self_attn.kv_a_proj_with_mqa.weight",
            ["kv_lora_rank + qk_rope_head_dim", "hidden_size"],
        ),
        _r(_L + "attention.kv_norm.weight", _H + "self_attn.kv_a_layernorm.weight", ["kv_lora_rank"]),
        _r(
            _L + "attention.wkv_b.weight",
            _H + "self_attn.kv_b_proj.weight",
            ["num_attention_heads * (qk_nope_head_dim + v_head_dim)", "kv_lora_rank"],
        ),
        _r(
            _L + "attention.wo.weight",
            _H + "self_attn.o_proj.weight",
            ["hidden_size", "num_attention_heads * v_head_dim"],
        ),
        *_norms(),
        *_mlp("feed_forward.", "intermediate_size", f"not ({_DSV3_MOE})"),
        *_experts("n_routed_experts", "moe_intermediate_size", _DSV3_MOE),
        *_mlp("moe.shared_experts.", "moe_intermediate_size * n_shared_experts", _DSV3_MOE, "mlp.shared_experts."),
        _r(
            _L + "moe.expert_bias_E",
            _H + "mlp.gate.e_score_correction_bias",
            ["n_routed_experts"],
            where=_DSV3_MOE,
            optional=True,
        ),
    ],
}

BUILTINS: dict[str, dict[str, Any]] = {m["mapping"]["name"]: m for m in (_LLAMA3, _QWEN3, _DSV3)}
"""The built-in mappings' tables, by name."""


def builtin(name: str) -> Mapping:
    return parse_mapping(BUILTINS[name])
