"""DeepSeek-V2/V3's ``config.json``: multi-head latent attention in every layer, and refusals,
by name, of what kvray does not serve yet (mixture-of-experts layers, other activations).

The two architectures differ here only in defaults: V3 keeps its first three layers dense and
rotates interleaved pairs when ``rope_interleave`` says so; V2's RoPE always rotates
interleaved pairs (its complex-number form) and its layers are MoE from the first."""

from __future__ import annotations

import math
from typing import Any

from workers.model_config import (
    MLAConfig,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
    common_fields,
    rope_settings,
)

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# transformers' defaults where the two configs differ, used when config.json leaves a field out.
DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(first_k_dense_replace=0, max_position_embeddings=2048),
    "DeepseekV3ForCausalLM": dict(first_k_dense_replace=3, max_position_embeddings=4096),
}


def parse_deepseek(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    architecture = raw["architectures"][0]
    defaults = DEFAULTS[architecture]
    num_layers = raw.get("num_hidden_layers", 61)
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"Unsupported hidden_act {raw['hidden_act']!r}; supported: silu"
        )
    _refuse_moe(raw, num_layers, defaults["first_k_dense_replace"])
    heads = raw.get("num_attention_heads", 128)
    mla = MLAConfig(
        kv_lora_rank=raw.get("kv_lora_rank", 512),
        q_lora_rank=raw.get("q_lora_rank", 1536),
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
        v_head_dim=raw.get("v_head_dim", 128),
        # V2's complex-number RoPE rotates the same interleaved pairs.
        rope_interleave=architecture == "DeepseekV2ForCausalLM"
        or bool(raw.get("rope_interleave", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    if mla.qk_rope_head_dim % 2:
        raise UnsupportedModelError(
            f"qk_rope_head_dim={mla.qk_rope_head_dim} must be even (RoPE rotates pairs)"
        )
    rope_theta, rope_scaling = rope_settings(raw)
    return ModelConfig(
        **common_fields(raw, generation),
        vocab_size=raw.get("vocab_size", 129280),
        hidden_size=raw.get("hidden_size", 7168),
        intermediate_size=raw.get("intermediate_size", 18432),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        # Every head reads the one latent: the cache holds a single head, whatever this says.
        num_key_value_heads=heads,
        head_dim=mla.qk_rope_head_dim,  # what RoPE rotates
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=raw.get(
            "max_position_embeddings", defaults["max_position_embeddings"]
        ),
        rope_scaling=rope_scaling,
        layer_types=("mla_attention",) * num_layers,
        mla=mla,
    )


def mla_softmax_scale(mla: MLAConfig, rope_scaling: RopeScaling | None) -> float:
    """``qk_head_dim ** -0.5``, times yarn's ``mscale(factor, mscale_all_dim) ** 2`` when the
    checkpoint sets ``mscale_all_dim`` (DeepSeek-V3's published configs do): the correction
    that keeps attention as sharp past the pretraining context as within it."""
    scale = mla.qk_head_dim**-0.5
    if rope_scaling is None or not rope_scaling.mscale_all_dim or rope_scaling.factor <= 1:
        return scale
    mscale = 0.1 * rope_scaling.mscale_all_dim * math.log(rope_scaling.factor) + 1.0
    return scale * mscale * mscale


def _refuse_moe(raw: dict[str, Any], num_layers: int, default_first_dense: int) -> None:
    """Layers from ``first_k_dense_replace`` on are MoE in these architectures."""
    first_dense = raw.get("first_k_dense_replace")
    first_dense = default_first_dense if first_dense is None else first_dense
    if first_dense < num_layers:
        raise UnsupportedModelError(
            f"Layers {first_dense}..{num_layers - 1} of this {raw['architectures'][0]} are "
            f"mixture-of-experts (MoE) layers (first_k_dense_replace={first_dense} < "
            f"num_hidden_layers={num_layers}); kvray does not serve MoE layers yet. Dense "
            "DeepSeek models (first_k_dense_replace >= num_hidden_layers) are served."
        )
