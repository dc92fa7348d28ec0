"""kvcore: the geometry of kvray's paged KV cache.

Specs describe one layer's cache; layouts permute the strides of the logical 5-D tensor
``[L, B, H, N, C]``; pure functions turn specs into byte strides; ``create_kv_cache_views``
turns strides into torch views. Importing kvcore does not import torch: the two view functions
load ``kvcore.views`` (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.agreement import check_rank_reports
from kvcore.attention_specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from kvcore.block_sizes import BlockSizes, resolve_kv_cache_block_sizes
from kvcore.cache_hit import CacheHit, StaleCacheHitError
from kvcore.coordinator import KVCacheCoordinator, needs_kv_cache_zeroing
from kvcore.coordinator_hybrid import HybridCoordinator  # the variants register themselves
from kvcore.coordinator_variants import NoPrefixCacheCoordinator, UnitaryCoordinator
from kvcore.dtypes import DTYPE_SIZES, KVQuantMode, get_kv_quant_mode, is_quantized_kv_cache
from kvcore.errors import (
    GeometryMismatchError,
    KVCacheGeometryError,
    KVCacheLayoutError,
    KVCacheSpecError,
    KVCacheSpecMergeError,
    TensorParallelError,
    WireFormatError,
)
from kvcore.geometry import (
    KVCacheTensor,
    build_kv_cache_tensor,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
)
from kvcore.grouping import get_kv_cache_groups
from kvcore.hashing import hash_token_ids
from kvcore.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvcore.kv_request import KVRequest
from kvcore.layout import KVCacheLayout, valid_layout_names
from kvcore.layout_resolution import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from kvcore.mamba_spec import MambaSpec
from kvcore.managers import UnsupportedSpecError, register_manager
from kvcore.planner import (
    InsufficientKVCacheMemoryError,
    get_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    validate_kv_cache_layout,
)
from kvcore.sharding import (
    kv_head_range,
    num_kv_heads_per_rank,
    shard_kv_cache_spec,
    shard_layer_specs,
)
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import AnyKVCacheSpec, UniformTypeKVCacheSpecs, iter_layer_specs
from kvcore.wire import (
    RankReport,
    decode,
    decode_kv_cache_tensor,
    decode_rank_report,
    decode_spec,
    encode,
)

if TYPE_CHECKING:
    from kvcore.views import create_kv_cache_views, group_kernel_blocks

_TORCH_NAMES = {"create_kv_cache_views", "group_kernel_blocks"}


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from kvcore import views

        return getattr(views, name)
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")


__all__ = [
    "DTYPE_SIZES",
    "AnyKVCacheSpec",
    "AttentionSpec",
    "BlockSizes",
    "CacheHit",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "FullAttentionSpec",
    "GeometryMismatchError",
    "HybridCoordinator",
    "InsufficientKVCacheMemoryError",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheGeometryError",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheLayoutError",
    "KVCacheSpec",
    "KVCacheSpecError",
    "KVCacheSpecMergeError",
    "KVCacheTensor",
    "KVQuantMode",
    "KVRequest",
    "MLAAttentionSpec",
    "MambaSpec",
    "NoPrefixCacheCoordinator",
    "RankReport",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StaleCacheHitError",
    "TensorParallelError",
    "UniformTypeKVCacheSpecs",
    "UnitaryCoordinator",
    "UnsupportedSpecError",
    "WireFormatError",
    "build_kv_cache_tensor",
    "check_rank_reports",
    "compute_layer_kv_cache_shape_bytes",
    "compute_layout_strides",
    "create_kv_cache_views",
    "decode",
    "decode_kv_cache_tensor",
    "decode_rank_report",
    "decode_spec",
    "encode",
    "get_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_kv_quant_mode",
    "get_supported_kv_cache_layouts",
    "group_kernel_blocks",
    "hash_token_ids",
    "is_quantized_kv_cache",
    "iter_layer_specs",
    "kv_head_range",
    "needs_kv_cache_zeroing",
    "num_kv_heads_per_rank",
    "register_manager",
    "resolve_kv_cache_block_sizes",
    "resolve_kv_cache_layout",
    "shard_kv_cache_spec",
    "shard_layer_specs",
    "valid_layout_names",
    "validate_kv_cache_layout",
]
