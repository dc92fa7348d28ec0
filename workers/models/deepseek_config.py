"""DeepSeek-V2/V3's ``config.json``: multi-head latent attention in every layer, dense MLPs
up to ``first_k_dense_replace`` and mixture-of-experts layers from there (routed experts plus
ungated shared ones), and refusals, by name, of what kvray does not serve.

The two architectures differ in defaults and routing: V3 keeps its first three layers dense,
rotates interleaved pairs when ``rope_interleave`` says so and routes by sigmoid scores with a
learned bias over expert groups (``noaux_tc``); V2's RoPE always rotates interleaved pairs
(its complex-number form), its layers are MoE from the first, and it routes by softmax,
greedily or limited to the best groups."""

from __future__ import annotations

import math
from typing import Any

from workers.model_config import (
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    UnsupportedModelError,
    common_fields,
    rope_settings,
)

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# transformers' defaults where the two configs differ, used when config.json leaves a field out.
DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(
        first_k_dense_replace=0, max_position_embeddings=2048, n_routed_experts=64,
        moe_intermediate_size=1407, n_shared_experts=2, routed_scaling_factor=1.0,
    ),
    "DeepseekV3ForCausalLM": dict(
        first_k_dense_replace=3, max_position_embeddings=4096, n_routed_experts=256,
        moe_intermediate_size=2048, n_shared_experts=1, routed_scaling_factor=2.5,
        num_experts_per_tok=8, n_group=8, topk_group=4,
    ),
}  # fmt: skip


def parse_deepseek(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    architecture = raw["architectures"][0]
    defaults = DEFAULTS[architecture]
    num_layers = raw.get("num_hidden_layers", 61)
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"Unsupported hidden_act {raw['hidden_act']!r}; supported: silu"
        )
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
        moe=_moe(
            defaults | {k: v for k, v in raw.items() if v is not None}, architecture, num_layers
        ),
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


# What each architecture's router can be told to do, as transformers implements it.
ROUTING = {
    "DeepseekV2ForCausalLM": {
        "scoring_func": ("softmax",),
        "topk_method": ("greedy", "group_limited_greedy"),
    },
    "DeepseekV3ForCausalLM": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
}


def _moe(raw: dict[str, Any], architecture: str, num_layers: int) -> MoEConfig | None:
    """Layers from ``first_k_dense_replace`` on are MoE; None when every layer is dense.
    ``raw`` is config.json over transformers' defaults for the architecture."""
    first_dense = raw["first_k_dense_replace"]
    if first_dense >= num_layers:
        return None
    if (raw.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedModelError(
            f"moe_layer_freq={raw['moe_layer_freq']} is not supported: every layer from "
            "first_k_dense_replace on must be MoE (moe_layer_freq 1, as published)"
        )
    allowed = ROUTING[architecture]
    routing = {
        "scoring_func": raw.get("scoring_func") or allowed["scoring_func"][0],
        "topk_method": raw.get("topk_method") or allowed["topk_method"][0],
    }
    for field, value in routing.items():
        if value not in allowed[field]:
            raise UnsupportedModelError(
                f"Unsupported {field} {value!r} for {architecture}; supported: "
                f"{', '.join(allowed[field])}"
            )
    num_experts = raw.get("num_local_experts") or raw["n_routed_experts"]
    width = raw["moe_intermediate_size"]
    n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
    grouped = routing["topk_method"] != "greedy"
    if grouped and (num_experts % n_group or not 1 <= topk_group <= n_group):
        raise UnsupportedModelError(
            f"n_group={n_group} must divide n_routed_experts={num_experts}, and topk_group="
            f"{topk_group} be between 1 and n_group"
        )
    top_k = raw.get("num_experts_per_tok") or 1
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts"
        )
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        # transformers' V2 router never renormalises, whatever norm_topk_prob says.
        norm_topk_prob=architecture == "DeepseekV3ForCausalLM"
        and bool(raw.get("norm_topk_prob", True)),
        layers=tuple(range(first_dense, num_layers)),
        shared_expert_intermediate_size=width * (raw.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        routing=routing["topk_method"],
        n_group=n_group if grouped else 1,
        topk_group=topk_group if grouped else 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        router_in_float32=True,
    )
