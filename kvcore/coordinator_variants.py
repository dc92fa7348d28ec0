"""The two simple coordinators: prefix caching off, and one KV-cache group."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.cache_hit import CacheHit
from kvcore.coordinator import KVCacheCoordinator, can_hit
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.kv_cache_config import KVCacheConfig
from kvcore.kv_request import KVRequest


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching off: every hit is empty; any number of groups (even none)."""

    @classmethod
    def serves(cls, config: KVCacheConfig, enable_caching: bool) -> bool:
        return not can_hit(config, enable_caching)

    def __init__(self, config: KVCacheConfig, *, max_num_batched_tokens: int) -> None:
        super().__init__(
            config,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=False,
            cache_hit_alignment=config.scheduler_block_size,
        )

    def find_longest_cache_hit(self, request: KVRequest) -> CacheHit:
        return self.empty_hit()


class UnitaryCoordinator(KVCacheCoordinator):
    """One group with caching on: hashes are exactly that group's blocks."""

    @classmethod
    def serves(cls, config: KVCacheConfig, enable_caching: bool) -> bool:
        return can_hit(config, enable_caching) and len(config.kv_cache_groups) == 1

    def __init__(self, config: KVCacheConfig, *, max_num_batched_tokens: int) -> None:
        if len(config.kv_cache_groups) != 1:
            raise ValueError(
                f"UnitaryCoordinator takes exactly one KV cache group, got "
                f"{len(config.kv_cache_groups)}"
            )
        block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
        if config.hash_block_size != block_size:
            raise ValueError(
                f"With one KV cache group the hash block size ({config.hash_block_size}) must "
                f"equal the block size ({block_size})"
            )
        super().__init__(
            config,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=True,
            cache_hit_alignment=block_size,
        )

    def _search(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[list[KVCacheBlock]], int]:
        return self.managers[0].find_longest_cache_hit(block_hashes, max_length, (0,))
