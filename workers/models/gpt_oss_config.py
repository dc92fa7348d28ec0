"""gpt-oss's ``config.json``: Llama-style attention with biases on every projection, a learned
sink logit per head, sliding-window and full layers alternating (``layer_types``), YaRN RoPE,
and in every layer a mixture of experts: a biased router whose top-k logits are softmaxed
among themselves, and experts with biases and a clamped SwiGLU. Published gpt-oss weights are
MXFP4-quantized and refused with every quantized checkpoint; bf16 ones are served."""

from __future__ import annotations

from typing import Any

from workers.model_config import (
    ModelConfig,
    MoEConfig,
    UnsupportedModelError,
    common_fields,
    rope_settings,
)
from workers.models.llama_config import attention_layer_types

ARCHITECTURES = ("GptOssForCausalLM",)


def parse_gpt_oss(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    common = common_fields(raw, generation)
    num_layers = raw.get("num_hidden_layers", 36)
    heads = raw.get("num_attention_heads", 64)
    hidden = raw.get("hidden_size", 2880)
    raw = {"sliding_window": 128, **raw}  # transformers' default window
    layer_types, window = attention_layer_types(raw, common["architecture"], num_layers)
    rope_theta, rope_scaling = rope_settings(raw)
    num_experts = raw.get("num_local_experts", 128)
    top_k = raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts"
        )
    width = raw.get("intermediate_size", 2880)
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=False,
        layers=tuple(range(num_layers)),
        routing="topk_softmax",
        activation="swiglu_oai",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        router_bias=True,
        expert_bias=True,
        stacked_layout="gpt_oss",
    )
    bias = bool(raw.get("attention_bias", True))
    return ModelConfig(
        **common,
        vocab_size=raw.get("vocab_size", 201088),
        hidden_size=hidden,
        intermediate_size=width,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        max_position_embeddings=raw.get("max_position_embeddings", 131072),
        rope_scaling=rope_scaling,
        qkv_bias=bias,
        o_proj_bias=bias,
        layer_types=layer_types,
        sliding_window=window,
        moe=moe,
    )
