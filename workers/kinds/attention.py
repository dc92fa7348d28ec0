"""Attention layers (full or sliding-window): a K/V spec per layer with the model's KV heads,
which kvcore shards over the TP ranks; each step the serving attention backend's metadata."""

from __future__ import annotations

from kvcore import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from workers.kinds.base import CacheKind, SpecContext
from workers.model_config import ModelConfig


def attention_layer_name(layer_index: int, module: str = "self_attn") -> str:
    return f"model.layers.{layer_index}.{module}.attn"


def _layer_name(config: ModelConfig, index: int) -> str:
    return attention_layer_name(index, config.attention_module)


def _attention_spec(context: SpecContext, index: int) -> KVCacheSpec:
    config = context.config
    fields = dict(
        block_size=context.block_size,
        num_kv_heads=config.num_key_value_heads,
        head_size=config.head_dim,
        dtype=context.dtype,
    )
    if config.layer_types[index] == "sliding_attention":
        return SlidingWindowSpec(**fields, sliding_window=config.sliding_window)
    return FullAttentionSpec(**fields)


ATTENTION = CacheKind(
    name="attention",
    layer_types=("full_attention", "sliding_attention"),
    spec_types=(FullAttentionSpec, SlidingWindowSpec),
    layer_name=_layer_name,
    layer_spec=_attention_spec,
    step_builder="workers.kinds.attention_step:AttentionStep",
)
