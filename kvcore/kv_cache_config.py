"""The plan the controller hands to every rank: groups, tensors, block counts and sizes.

``KVCacheConfig`` is msgspec-encodable (``kvcore.encode`` / ``kvcore.decode(data,
KVCacheConfig)``), so the controller sends each worker exactly the plan it made.
"""

from __future__ import annotations

import msgspec

from kvcore.geometry import KVCacheTensor
from kvcore.uniform_spec import AnyKVCacheSpec, UniformTypeKVCacheSpecs


class KVCacheGroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Layers that share one block table: one block id addresses a page in every one of them.

    ``kv_cache_spec`` is the merged spec of the layers, or a ``UniformTypeKVCacheSpecs``
    when they are one family with different page sizes.
    """

    layer_names: list[str]
    kv_cache_spec: AnyKVCacheSpec

    def layer_spec(self, layer_name: str) -> AnyKVCacheSpec:
        """The per-layer spec of ``layer_name`` (a wrapper is resolved to its member)."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.kv_cache_specs[layer_name]
        return spec


class KVCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Blocks in the shared pool, block 0 (the null block) included; equal on every rank.
    num_blocks: int
    # Every tensor overlays one backing allocation of ``kv_cache_tensors[i].size`` bytes.
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    # The resolved layout's name; every rank builds its views with it.
    layout: str
    # Tokens per scheduler block: the lcm of the groups' block sizes.
    scheduler_block_size: int
    # Tokens per prefix-cache hash: the gcd of the prefix-cacheable groups' block sizes.
    hash_block_size: int
    # Prefix-cache hits are rounded down to a multiple of this many tokens.
    cache_hit_alignment: int
    max_model_len: int
    # How many tokens the cache holds for requests of max_model_len, and how many such
    # requests fit at once.
    capacity_tokens: int = 0
    max_concurrency: float = 0.0

    @property
    def bytes_per_block(self) -> int:
        return self.kv_cache_tensors[0].size // self.num_blocks if self.kv_cache_tensors else 0

    def group_of(self, layer_name: str) -> int:
        for index, group in enumerate(self.kv_cache_groups):
            if layer_name in group.layer_names:
                return index
        raise KeyError(f"layer {layer_name!r} is in no KV cache group")
