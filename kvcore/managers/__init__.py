"""Per-group block managers and the spec class -> manager class registry.

Lookups walk the spec's MRO, so ``MLAAttentionSpec`` is managed as full attention and
``SlidingWindowMLASpec`` as a sliding window; a ``UniformTypeKVCacheSpecs`` group is managed by
the manager of its first member.
"""

from __future__ import annotations

from kvcore.attention_specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from kvcore.block_pool import BlockPool
from kvcore.mamba_spec import MambaSpec
from kvcore.managers.base import NEVER, GroupManager, HitResult
from kvcore.managers.chunked_local import ChunkedLocalAttentionManager
from kvcore.managers.circular_buffer import CircularBufferManager
from kvcore.managers.full_attention import FullAttentionManager
from kvcore.managers.mamba import MambaManager
from kvcore.managers.sliding_window import SlidingWindowManager
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import UniformTypeKVCacheSpecs


class UnsupportedSpecError(ValueError):
    """No block manager is registered for a KV-cache spec class."""


_MANAGERS: dict[type[KVCacheSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    CircularBufferSpec: CircularBufferManager,
    MambaSpec: MambaManager,
}


def register_manager(spec_cls: type[KVCacheSpec], manager_cls: type[GroupManager]) -> None:
    """Manage ``spec_cls`` (and its subclasses without their own entry) with ``manager_cls``."""
    existing = _MANAGERS.get(spec_cls)
    if existing is not None and existing is not manager_cls:
        raise ValueError(
            f"Conflicting registration for {spec_cls.__name__}: already managed by "
            f"{existing.__name__}, not {manager_cls.__name__}"
        )
    _MANAGERS[spec_cls] = manager_cls


def manager_class_for_spec(spec: KVCacheSpec) -> type[GroupManager]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    for cls in type(spec).__mro__:
        manager_cls = _MANAGERS.get(cls)
        if manager_cls is not None:
            return manager_cls
    raise UnsupportedSpecError(f"No manager found for KV cache spec type {type(spec).__name__}")


def make_manager(
    spec: KVCacheSpec,
    block_pool: BlockPool,
    group_id: int,
    *,
    hash_block_size: int,
    cache_hit_alignment: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_caching: bool = True,
    needs_zeroing: bool = False,
) -> GroupManager:
    """The manager of one group. Windowed groups get the same admission cap the pool sizer
    used (``max_admission_blocks_per_request``), so runtime admission matches startup sizing."""
    manager_cls = manager_class_for_spec(spec)
    behaviour_spec = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    max_admission_blocks = None
    if isinstance(behaviour_spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
        max_admission_blocks = behaviour_spec.max_admission_blocks_per_request(
            max_num_batched_tokens, max_model_len
        )
    return manager_cls(
        spec,
        block_pool,
        group_id,
        hash_block_size=hash_block_size,
        cache_hit_alignment=cache_hit_alignment,
        enable_caching=enable_caching,
        needs_zeroing=needs_zeroing,
        max_admission_blocks=max_admission_blocks,
    )


__all__ = [
    "NEVER",
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "FullAttentionManager",
    "GroupManager",
    "HitResult",
    "MambaManager",
    "SlidingWindowManager",
    "UnsupportedSpecError",
    "make_manager",
    "manager_class_for_spec",
    "register_manager",
]
