"""The KV-cache spec of every attention layer, from the model config alone (no torch, no
weights): the controller uses it to check ranks and to plan, and ``kvray plan`` to print."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, shard_layer_specs
from workers.model_config import ModelConfig

CustomizeSpec = Callable[[KVCacheSpec], KVCacheSpec]


def attention_layer_name(layer_index: int) -> str:
    return f"model.layers.{layer_index}.self_attn.attn"


def global_kv_cache_specs(
    config: ModelConfig, block_size: int, kv_cache_dtype: str | None = None
) -> dict[str, KVCacheSpec]:
    """One spec per attention layer, in layer order, with the model's total KV heads."""
    dtype = kv_cache_dtype or config.dtype
    specs: dict[str, KVCacheSpec] = {}
    for index in range(config.num_hidden_layers):
        fields = dict(
            block_size=block_size,
            num_kv_heads=config.num_key_value_heads,
            head_size=config.head_dim,
            dtype=dtype,
        )
        if config.is_sliding(index):
            spec = SlidingWindowSpec(**fields, sliding_window=config.sliding_window)
        else:
            spec = FullAttentionSpec(**fields)
        specs[attention_layer_name(index)] = spec
    return specs


def rank_kv_cache_specs(
    config: ModelConfig,
    block_size: int,
    tp_size: int,
    rank: int,
    customize_spec: CustomizeSpec | None = None,
    kv_cache_dtype: str | None = None,
) -> dict[str, KVCacheSpec]:
    """This rank's specs: the global ones sharded by kvcore, then passed through the attention
    backend's ``customize_spec`` hook (its production call site)."""
    sharded = shard_layer_specs(
        global_kv_cache_specs(config, block_size, kv_cache_dtype), tp_size, rank
    )
    if customize_spec is None:
        return sharded
    return {name: customize_spec(spec) for name, spec in sharded.items()}
