"""Chunked local attention: tokens attend only within their ``attention_chunk_size`` chunk."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._math import round_up
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.managers.base import GroupManager, HitResult


class ChunkedLocalAttentionManager(GroupManager):
    """Blocks of finished chunks are freed. A hit marks every block before the chunk that
    holds ``max_length`` as computed (null), then scans that chunk's blocks left to right."""

    frees_blocks_early = True

    def __init__(self, spec, block_pool, group_id, **kwargs) -> None:
        super().__init__(spec, block_pool, group_id, **kwargs)
        self.attention_chunk_size: int = self.spec.attention_chunk_size
        if self.enable_caching and self.block_size != self.cache_hit_alignment:
            raise ValueError(
                "KV cache groups with different block sizes are not compatible with chunked "
                f"local attention now (block size {self.block_size}, cache hit alignment "
                f"{self.cache_hit_alignment})"
            )

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def next_skip_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        num_skipped_blocks = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        return round_up((num_skipped_blocks + 1) * self.block_size, self.attention_chunk_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> HitResult:
        block_size = self.block_size
        hashes = self._block_hashes(block_hashes)
        num_max_blocks = max_length // block_size
        chunk_start = max_length // self.attention_chunk_size * self.attention_chunk_size
        num_null_blocks = chunk_start // block_size
        per_group: list[list[KVCacheBlock]] = [
            [self.null_block] * num_null_blocks for _ in group_ids
        ]
        pool = self.block_pool
        for index in range(num_null_blocks, min(num_max_blocks, len(hashes))):
            blocks = pool.get_cached_blocks(hashes[index], group_ids)
            if blocks is None:
                break
            for found, block in zip(per_group, blocks, strict=True):
                found.append(block)
        return per_group, len(per_group[0]) * block_size
