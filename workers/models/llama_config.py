"""The Llama family's ``config.json`` (Llama, Mistral, Qwen2, Qwen3, and the sparse Mixtral,
Qwen2-MoE and Qwen3-MoE): what distinguishes them (biases, Q/K norms, sliding windows, which
layers route to experts) and refusals, by name, of what kvray does not serve."""

from __future__ import annotations

from typing import Any

from workers.model_config import (
    ModelConfig,
    MoEConfig,
    UnsupportedModelError,
    common_fields,
    rope_settings,
)

DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SPARSE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ARCHITECTURES = DENSE + SPARSE
QWEN2_ATTENTION = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # Q/K/V biases
QWEN3_ATTENTION = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # Q/K norms


def parse_llama(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    common = common_fields(raw, generation)
    architecture = common["architecture"]
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    layer_types, window = attention_layer_types(raw, architecture, num_layers)
    rope_theta, rope_scaling = rope_settings(raw)
    return ModelConfig(
        **common,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw.get("intermediate_size") or 0,  # Mixtral's is its experts'
        moe=_moe(raw, architecture, num_layers),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope_scaling=rope_scaling,
        **_biases(raw, architecture),
        qk_norm=architecture in QWEN3_ATTENTION,
        layer_types=layer_types,
        sliding_window=window,
    )


def attention_layer_types(raw: dict[str, Any], architecture: str, num_layers: int):
    """Which layers use a sliding window, and the window (None when no layer does)."""
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"Unsupported hidden_act {hidden_act!r}; supported: silu")
    window = raw.get("sliding_window")
    if architecture in QWEN2_ATTENTION + QWEN3_ATTENTION and not raw.get("use_sliding_window"):
        window = None
    types = raw.get("layer_types")
    if types is None:
        kind = "sliding_attention" if window is not None else "full_attention"
        types = [kind] * num_layers
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(
            f"layer_types must name full_attention or sliding_attention for each of the "
            f"{num_layers} layers, got {types}"
        )
    if window is None:
        types = ["full_attention"] * num_layers
    return tuple(types), window


def _biases(raw: dict[str, Any], architecture: str) -> dict[str, bool]:
    """Which projections carry a bias: Qwen2 always on Q/K/V only; Mistral never; Llama and
    Qwen3 on Q/K/V/O when ``attention_bias`` (and Llama on the MLP when ``mlp_bias``)."""
    if architecture in QWEN2_ATTENTION:
        qkv_bias = bool(raw.get("qkv_bias", True))  # Qwen2-MoE's config may turn them off
        return {"qkv_bias": qkv_bias, "o_proj_bias": False, "mlp_bias": False}
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return {"qkv_bias": False, "o_proj_bias": False, "mlp_bias": False}
    attention_bias = bool(raw.get("attention_bias"))
    mlp_bias = architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias"))
    return {"qkv_bias": attention_bias, "o_proj_bias": attention_bias, "mlp_bias": mlp_bias}


def _moe(raw: dict[str, Any], architecture: str, num_layers: int) -> MoEConfig | None:
    """Mixtral: every layer is MoE, its experts ``intermediate_size`` wide, top-k weights
    always renormalised. Qwen2/3-MoE: layer i is MoE unless in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step``; experts ``moe_intermediate_size`` wide; the dense
    layers' MLP ``intermediate_size``; Qwen2-MoE adds a gated shared expert."""
    if architecture not in SPARSE:
        return None
    # Published configs write num_experts (Qwen) or num_local_experts (Mixtral); transformers
    # 5 writes num_local_experts for both.
    num_experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if architecture == "MixtralForCausalLM":
        width, norm = raw["intermediate_size"], True
        layers = tuple(range(num_layers))
    else:
        width = raw["moe_intermediate_size"]
        norm = bool(raw.get("norm_topk_prob", False))
        step, dense = raw.get("decoder_sparse_step") or 1, set(raw.get("mlp_only_layers") or ())
        layers = tuple(
            i for i in range(num_layers) if i not in dense and num_experts and (i + 1) % step == 0
        )
    top_k = raw["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts"
        )
    shared = raw.get("shared_expert_intermediate_size") or 0
    if architecture != "Qwen2MoeForCausalLM":
        shared = 0
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=norm,
        layers=layers,
        shared_expert_intermediate_size=shared,
    )
