"""Mamba-2 mixer layers (a hybrid's ``mamba`` layers): one ``MambaSpec`` each, whose page holds
the layer's conv state ``[K-1, conv_dim]`` and SSM state ``[H, P, N]`` end to end; tensor
parallelism splits conv_dim and the heads. With prefix caching a state is kept every
``StateCaching.interval`` tokens (kvcore's "align" mode); without, one per request. While
speculating each request also holds one block per draft a step may carry
(``num_speculative_blocks``: the state after each draft, for undoing rejected ones;
``workers.kinds.mamba_metadata``)."""

from __future__ import annotations

from kvcore import KVCacheSpec, MambaSpec
from workers.kinds.base import CacheKind, SpecContext
from workers.model_config import MambaConfig

# The axis tensor parallelism splits in each Mamba state: conv_dim of the conv state, the
# heads of the SSM state.
MAMBA_STATE_HEAD_AXES = (1, 0)


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


def _mamba_spec(context: SpecContext, index: int) -> KVCacheSpec:
    mamba, caching = context.config.mamba, context.state_caching
    fields = dict(
        shapes=mamba_state_shapes(mamba, context.tp_size),
        dtypes=(context.state_dtype, mamba.ssm_cache_dtype),
    )
    if caching is None:
        return MambaSpec(
            block_size=context.block_size,
            mamba_cache_mode="none",
            num_speculative_blocks=context.num_speculative_tokens,
            **fields,
        )
    return MambaSpec(
        block_size=caching.interval,
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=caching.num_checkpoints,
        num_speculative_blocks=context.num_speculative_tokens,
        **fields,
    )


MAMBA = CacheKind(
    name="mamba",
    layer_types=("mamba",),
    spec_types=(MambaSpec,),
    layer_name=lambda config, index: mamba_layer_name(index),
    layer_spec=_mamba_spec,
    step_builder="workers.kinds.mamba_metadata:MambaStep",
    state_head_axes=MAMBA_STATE_HEAD_AXES,
    splits_into_kernel_blocks=False,
)
