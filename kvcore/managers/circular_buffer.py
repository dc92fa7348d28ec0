"""Circular buffer: one ring block per request holding the raw keys still being compressed."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.kv_request import KVRequest
from kvcore.managers.base import NEVER, GroupManager, HitResult


class CircularBufferManager(GroupManager):
    """Exactly one block per request, reused circularly by the kernel; never cached (the ring
    holds a moving window, not a prefix) and never reported for zeroing."""

    zeroes_new_blocks = False

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> HitResult:
        return self._no_hit(group_ids)

    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        table = self.req_to_blocks[request_id]
        if table:
            return []
        table.extend(self.block_pool.get_new_blocks(1))
        return list(table)

    def capacity_tokens(self, request_id: str) -> int:
        return NEVER if self.req_to_blocks[request_id] else 0

    def next_cache_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        return NEVER

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        return

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        return
