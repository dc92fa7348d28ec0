"""The Llama family's ``config.json`` (Llama, Mistral, Qwen2, Qwen3): what distinguishes
them (biases, Q/K norms, sliding windows) and refusals, by name, of what kvray does not serve."""

from __future__ import annotations

from typing import Any

from workers.model_config import ModelConfig, UnsupportedModelError, common_fields, rope_settings

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def parse_llama(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    common = common_fields(raw, generation)
    architecture = common["architecture"]
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    layer_types, window = _layer_types(raw, architecture, num_layers)
    rope_theta, rope_scaling = rope_settings(raw)
    return ModelConfig(
        **common,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope_scaling=rope_scaling,
        **_biases(raw, architecture),
        qk_norm=architecture == "Qwen3ForCausalLM",
        layer_types=layer_types,
        sliding_window=window,
    )


def _layer_types(raw: dict[str, Any], architecture: str, num_layers: int):
    """Which layers use a sliding window, and the window (None when no layer does)."""
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"Unsupported hidden_act {hidden_act!r}; supported: silu")
    window = raw.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get(
        "use_sliding_window"
    ):
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
    if architecture == "Qwen2ForCausalLM":
        return {"qkv_bias": True, "o_proj_bias": False, "mlp_bias": False}
    if architecture == "MistralForCausalLM":
        return {"qkv_bias": False, "o_proj_bias": False, "mlp_bias": False}
    attention_bias = bool(raw.get("attention_bias"))
    mlp_bias = architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias"))
    return {"qkv_bias": attention_bias, "o_proj_bias": attention_bias, "mlp_bias": mlp_bias}
