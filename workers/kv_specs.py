"""The KV-cache spec of every layer that keeps state, from the model config alone (no torch, no
weights): the controller uses it to check ranks and to plan, and ``kvray plan`` to print.

Each layer's kind (``workers.kinds``: attention, a Mamba mixer, latent attention...) makes its
spec; a layer that is only an MLP keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcore import KVCacheSpec, shard_layer_specs
from workers.kinds import SpecContext, StateCaching, kind_of_layer
from workers.model_config import ModelConfig

CustomizeSpec = Callable[[KVCacheSpec], KVCacheSpec]


def global_kv_cache_specs(
    config: ModelConfig,
    block_size: int,
    kv_cache_dtype: str | None = None,
    tp_size: int = 1,
    state_caching: StateCaching | None = None,
    *,
    model_dtype: str | None = None,
    num_speculative_tokens: int = 0,
    layers: range | None = None,
) -> dict[str, KVCacheSpec]:
    """One spec per stateful layer, in layer order, with the model's total KV heads (and, for
    recurrent states, the geometry that shards into each rank's at ``tp_size``). Attention
    caches are stored in ``kv_cache_dtype``, recurrent states in ``model_dtype`` (both the
    checkpoint's when not given). With ``num_speculative_tokens`` drafts per step, a
    recurrent layer also keeps the state after each draft. ``layers``: a pipeline stage's
    decoder layers, the only ones whose specs it reports (None: all)."""
    state_dtype = model_dtype or config.dtype
    context = SpecContext(
        config,
        block_size,
        kv_cache_dtype or state_dtype,
        tp_size,
        state_caching,
        state_dtype,
        num_speculative_tokens,
    )
    specs: dict[str, KVCacheSpec] = {}
    for index, layer_type in enumerate(config.layer_types):
        kind = kind_of_layer(layer_type)
        if kind is not None and (layers is None or index in layers):
            specs[kind.layer_name(config, index)] = kind.layer_spec(context, index)
    return specs


def state_head_axes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The TP-split axis of each recurrent layer's states, for kvcore's sharding and rank
    check (the layers of kinds whose states TP splits along their own axes)."""
    axes = {}
    for index, layer_type in enumerate(config.layer_types):
        kind = kind_of_layer(layer_type)
        if kind is not None and kind.state_head_axes is not None:
            axes[kind.layer_name(config, index)] = kind.state_head_axes
    return axes


def rank_kv_cache_specs(
    config: ModelConfig,
    block_size: int,
    tp_size: int,
    rank: int,
    customize_spec: CustomizeSpec | None = None,
    kv_cache_dtype: str | None = None,
    state_caching: StateCaching | None = None,
    *,
    model_dtype: str | None = None,
    num_speculative_tokens: int = 0,
    layers: range | None = None,
) -> dict[str, KVCacheSpec]:
    """This rank's specs (of a pipeline stage's ``layers`` only, when given): the global ones
    sharded by kvcore, then passed through the attention backend's ``customize_spec`` hook
    (its production call site)."""
    global_specs = global_kv_cache_specs(
        config,
        block_size,
        kv_cache_dtype,
        tp_size,
        state_caching,
        model_dtype=model_dtype,
        num_speculative_tokens=num_speculative_tokens,
        layers=layers,
    )
    sharded = shard_layer_specs(
        global_specs,
        tp_size,
        rank,
        state_head_axes=state_head_axes(config),
    )
    if customize_spec is None:
        return sharded
    return {name: customize_spec(spec) for name, spec in sharded.items()}
