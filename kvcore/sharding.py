"""Tensor-parallel sharding of KV geometry: what one rank holds of a layer's cache.

Attention KV heads are split across ranks when they divide evenly, and replicated when there are
fewer heads than ranks (each rank then holds one head, shared by ``tp_size // num_kv_heads``
ranks). MLA's single latent head is whole on every rank. A recurrent state is split along its
head axis, unless it is ``tp_replicated``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from kvcore.attention_specs import AttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec
from kvcore.errors import TensorParallelError
from kvcore.mamba_spec import MambaSpec
from kvcore.spec_base import KVCacheSpec


def _check_rank(tp_size: int, rank: int) -> None:
    if isinstance(tp_size, bool) or tp_size < 1:
        raise TensorParallelError(f"tensor parallel size must be >= 1, got {tp_size}")
    if not 0 <= rank < tp_size:
        raise TensorParallelError(
            f"rank {rank} is outside tensor parallel size {tp_size} (ranks 0..{tp_size - 1})"
        )


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: split when ``num_kv_heads % tp == 0``, one replicated head
    when ``tp % num_kv_heads == 0``, refused otherwise."""
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads == 0:
        return 1
    raise TensorParallelError(
        f"num_kv_heads={num_kv_heads} cannot be sharded over tensor parallel size {tp_size}: "
        f"it must be divisible by {tp_size} (heads are split) or divide {tp_size} "
        "(heads are replicated). Choose a tensor parallel size that divides or is a "
        f"multiple of {num_kv_heads}."
    )


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV head indices that ``rank`` holds (used to slice K/V weights)."""
    _check_rank(tp_size, rank)
    per_rank = num_kv_heads_per_rank(num_kv_heads, tp_size)
    if num_kv_heads >= tp_size:
        return range(rank * per_rank, (rank + 1) * per_rank)
    first = rank // (tp_size // num_kv_heads)  # replicated: consecutive ranks share a head
    return range(first, first + 1)


def _is_latent(spec: KVCacheSpec) -> bool:
    return isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec)


def shard_kv_cache_spec(
    spec: KVCacheSpec,
    tp_size: int,
    rank: int,
    *,
    state_head_axes: Sequence[int] | None = None,
) -> KVCacheSpec:
    """``rank``'s spec of a layer whose global (unsharded) geometry is ``spec``.

    ``state_head_axes`` gives, per recurrent state shape, the axis that TP splits (axis 0 of
    every shape by default).
    """
    _check_rank(tp_size, rank)
    if isinstance(spec, MambaSpec):
        return _shard_state(spec, tp_size, state_head_axes)
    if not isinstance(spec, AttentionSpec):
        raise TensorParallelError(f"{type(spec).__name__} has no tensor-parallel sharding rule")
    if _is_latent(spec):
        if spec.num_kv_heads != 1:
            raise TensorParallelError(
                f"{type(spec).__name__} holds one latent head, got num_kv_heads={spec.num_kv_heads}"
            )
        return spec
    heads = num_kv_heads_per_rank(spec.num_kv_heads, tp_size)
    return msgspec.structs.replace(spec, num_kv_heads=heads)


def _shard_state(spec: MambaSpec, tp_size: int, state_head_axes: Sequence[int] | None) -> MambaSpec:
    if spec.tp_replicated or tp_size == 1:
        return spec
    axes = tuple(state_head_axes) if state_head_axes is not None else (0,) * len(spec.shapes)
    if len(axes) != len(spec.shapes):
        raise TensorParallelError(
            f"state_head_axes names {len(axes)} axes for {len(spec.shapes)} state shapes"
        )
    shapes = []
    for index, (shape, axis) in enumerate(zip(spec.shapes, axes, strict=True)):
        if not -len(shape) <= axis < len(shape):
            raise TensorParallelError(f"state {index} of shape {shape} has no axis {axis}")
        axis %= len(shape)
        if shape[axis] % tp_size != 0:
            raise TensorParallelError(
                f"State {index} of shape {shape} cannot be split over tensor parallel size "
                f"{tp_size}: its head axis {axis} has {shape[axis]} entries, not a multiple of "
                f"{tp_size}. Mark the state tp_replicated or choose another TP size."
            )
        shapes.append((*shape[:axis], shape[axis] // tp_size, *shape[axis + 1 :]))
    # Padding is a planning decision made per rank, so a shard starts unpadded.
    return msgspec.structs.replace(spec, shapes=tuple(shapes), page_size_padded=None)


def shard_layer_specs(
    global_specs: Mapping[str, KVCacheSpec],
    tp_size: int,
    rank: int,
    *,
    state_head_axes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, KVCacheSpec]:
    """Shard every layer's spec for ``rank``; errors name the layer."""
    sharded = {}
    for layer_name, spec in global_specs.items():
        axes = (state_head_axes or {}).get(layer_name)
        try:
            sharded[layer_name] = shard_kv_cache_spec(spec, tp_size, rank, state_head_axes=axes)
        except TensorParallelError as exc:
            raise TensorParallelError(f"Layer '{layer_name}': {exc}") from exc
    return sharded
