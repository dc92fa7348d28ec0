"""The KV-cache spec of every layer that keeps state, from the model config alone (no torch, no
weights): the controller uses it to check ranks and to plan, and ``kvray plan`` to print.

Attention layers get an attention spec; a hybrid's Mamba layers get one ``MambaSpec`` each,
whose page holds the layer's conv state ``[K-1, conv_dim]`` and SSM state ``[H, P, N]`` end to
end; MLP-only layers keep nothing. A DeepSeek layer's spec is an ``MLAAttentionSpec``: one
latent "head" of ``kv_lora_rank + qk_rope_head_dim`` values per token and no separate V. Its
query heads are split over the TP ranks but the latent is not: kvcore keeps an MLA spec whole
on every rank, and the startup rank check compares each rank's latent with the whole one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcore import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    shard_layer_specs,
)
from workers.model_config import MambaConfig, ModelConfig, UnsupportedModelError

CustomizeSpec = Callable[[KVCacheSpec], KVCacheSpec]


@dataclass(frozen=True)
class StateCaching:
    """How a hybrid's Mamba states feed the prefix cache: a state every ``interval`` tokens
    (the Mamba groups' block size, kvcore's "align" mode), every boundary a step crosses
    checkpointed, so a step of ``max_num_batched_tokens`` tokens may save that many over
    ``interval`` states on top of the current one and its copy source. Without it
    (prefix caching off) each request holds one state and never hits."""

    interval: int
    max_num_batched_tokens: int

    @property
    def num_checkpoints(self) -> int:
        return -(-self.max_num_batched_tokens // self.interval)


# The axis tensor parallelism splits in each Mamba state: conv_dim of the conv state, the
# heads of the SSM state.
MAMBA_STATE_HEAD_AXES = (1, 0)


def attention_layer_name(layer_index: int, mixer: str = "self_attn") -> str:
    return f"model.layers.{layer_index}.{mixer}.attn"


def mamba_layer_name(layer_index: int) -> str:
    return f"model.layers.{layer_index}.mixer"


def mamba_state_shapes(mamba: MambaConfig, tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
    """The global (conv, SSM) state shapes of one Mamba layer at ``tp_size``.

    Each rank's conv state holds its heads' x channels and its B/C groups. A single group is
    replicated on every rank, so the global conv state counts it once per rank (upstream's
    "extended" group count): sharding ``conv_dim`` by ``tp_size`` then gives each rank's width.
    """
    groups = mamba.groups_per_rank(tp_size) * tp_size
    conv_dim = mamba.intermediate_size + 2 * groups * mamba.state_size
    return (
        (mamba.conv_kernel - 1, conv_dim),
        (mamba.num_heads, mamba.head_dim, mamba.state_size),
    )


def _mamba_spec(
    config: ModelConfig, block_size: int, dtype: str, tp_size: int, caching: StateCaching | None
) -> MambaSpec:
    fields = dict(
        shapes=mamba_state_shapes(config.mamba, tp_size),
        dtypes=(dtype, config.mamba.ssm_cache_dtype),
    )
    if caching is None:
        return MambaSpec(block_size=block_size, mamba_cache_mode="none", **fields)
    return MambaSpec(
        block_size=caching.interval,
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=caching.num_checkpoints,
        **fields,
    )


def _layer_spec(
    config: ModelConfig,
    index: int,
    block_size: int,
    dtype: str,
    tp_size: int,
    caching: StateCaching | None,
) -> tuple[str, KVCacheSpec] | None:
    kind = config.layer_types[index]
    if kind == "mlp":
        return None
    if kind == "mamba":
        return mamba_layer_name(index), _mamba_spec(config, block_size, dtype, tp_size, caching)
    if kind == "mla_attention":
        if config.num_attention_heads % tp_size:
            raise UnsupportedModelError(
                f"num_attention_heads={config.num_attention_heads} is not divisible by tensor "
                f"parallel size {tp_size}: MLA splits the query heads over the ranks (each "
                "keeps the whole latent); choose a tensor parallel size that divides it."
            )
        latent = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=config.mla.latent_size,
            head_size_v=0,
            dtype=dtype,
        )
        return attention_layer_name(index), latent
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
    mixer = "self_attn" if config.mamba is None else "mixer"
    return attention_layer_name(index, mixer), spec


def global_kv_cache_specs(
    config: ModelConfig,
    block_size: int,
    kv_cache_dtype: str | None = None,
    tp_size: int = 1,
    state_caching: StateCaching | None = None,
) -> dict[str, KVCacheSpec]:
    """One spec per stateful layer, in layer order, with the model's total KV heads (and, for
    Mamba states, the geometry that shards into each rank's at ``tp_size``)."""
    dtype = kv_cache_dtype or config.dtype
    specs: dict[str, KVCacheSpec] = {}
    for index in range(config.num_hidden_layers):
        entry = _layer_spec(config, index, block_size, dtype, tp_size, state_caching)
        if entry is not None:
            specs[entry[0]] = entry[1]
    return specs


def state_head_axes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The TP-split axis of each Mamba layer's states, for kvcore's sharding and rank check."""
    return {
        mamba_layer_name(index): MAMBA_STATE_HEAD_AXES
        for index, kind in enumerate(config.layer_types)
        if kind == "mamba"
    }


def rank_kv_cache_specs(
    config: ModelConfig,
    block_size: int,
    tp_size: int,
    rank: int,
    customize_spec: CustomizeSpec | None = None,
    kv_cache_dtype: str | None = None,
    state_caching: StateCaching | None = None,
) -> dict[str, KVCacheSpec]:
    """This rank's specs: the global ones sharded by kvcore, then passed through the attention
    backend's ``customize_spec`` hook (its production call site)."""
    sharded = shard_layer_specs(
        global_kv_cache_specs(config, block_size, kv_cache_dtype, tp_size, state_caching),
        tp_size,
        rank,
        state_head_axes=state_head_axes(config),
    )
    if customize_spec is None:
        return sharded
    return {name: customize_spec(spec) for name, spec in sharded.items()}
