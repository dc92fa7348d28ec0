"""Full attention (MLA included): every token attends to the whole prefix, nothing is skipped."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._math import cdiv
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.kv_request import KVRequest
from kvcore.managers.base import GroupManager, HitResult


class FullAttentionManager(GroupManager):
    """Hits are a run of cached blocks from the start (hashes are chained, so the first miss
    ends the run).

    Fine-grained lookup: when the hit alignment is finer than the block (and divides it), the
    hit may go on inside the first block that missed, up to the last cached hash unit: such a
    partial key is registered by ``cache_blocks`` at the last hash-unit boundary of the prompt.
    A coordinator that hands out such a hit must copy the shared tail block before the request
    writes into it (copy-on-write); kvray's coordinators keep the alignment at whole blocks, so
    they never produce one.
    """

    @property
    def is_fine_grained(self) -> bool:
        alignment = self.cache_hit_alignment
        return alignment < self.block_size and self.block_size % alignment == 0

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> HitResult:
        block_size = self.block_size
        hashes = self._block_hashes(block_hashes)
        num_max_blocks = min(max_length // block_size, len(hashes))
        per_group: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        pool = self.block_pool
        if len(group_ids) == 1:
            found = per_group[0]
            group_id = group_ids[0]
            for index in range(num_max_blocks):
                block = pool.get_cached_block(hashes[index], group_id)
                if block is None:
                    break
                found.append(block)
        else:
            for index in range(num_max_blocks):
                blocks = pool.get_cached_blocks(hashes[index], group_ids)
                if blocks is None:
                    break
                for found, block in zip(per_group, blocks, strict=True):
                    found.append(block)
        num_hit_tokens = len(per_group[0]) * block_size
        if self.is_fine_grained:
            num_hit_tokens = self._extend_inside_block(
                block_hashes, max_length, group_ids, per_group, num_hit_tokens
            )
        return _align_hit(per_group, num_hit_tokens, self.cache_hit_alignment, block_size)

    def _extend_inside_block(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        per_group: list[list[KVCacheBlock]],
        num_hit_tokens: int,
    ) -> int:
        """Probe the hash units of the first uncached block, last to first; the first cached
        unit on an aligned boundary extends the hit into that block."""
        unit = self.hash_block_size
        first_unit = num_hit_tokens // unit
        # The block's last unit is its full key, which already missed (or is past max_length).
        end_unit = min(max_length // unit, first_unit + self.block_size // unit - 1)
        end_unit = min(end_unit, len(block_hashes))
        for unit_index in range(end_unit - 1, first_unit - 1, -1):
            num_tokens = (unit_index + 1) * unit
            if num_tokens % self.cache_hit_alignment:
                continue
            blocks = self.block_pool.get_cached_blocks(block_hashes[unit_index], group_ids)
            if blocks is not None:
                for found, block in zip(per_group, blocks, strict=True):
                    found.append(block)
                return num_tokens
        return num_hit_tokens

    def next_cache_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        if self.is_fine_grained:
            return 0  # the prompt-tail key may be due at any count: always look
        return super().next_cache_tokens(request_id, num_computed_tokens)

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        super().cache_blocks(request, num_computed_tokens)
        if self.is_fine_grained:
            self._cache_prompt_tail(request, num_computed_tokens)

    def _cache_prompt_tail(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Register the prompt's last hash-unit boundary when it ends inside a block, so a
        request with the same prompt can hit up to it."""
        unit = self.hash_block_size
        boundary = request.num_prompt_tokens // unit * unit
        if boundary == 0 or boundary % self.block_size == 0 or boundary > num_computed_tokens:
            return
        table = self.req_to_blocks.get(request.request_id)
        index = boundary // self.block_size
        if table is None or index >= len(table):
            return
        block_hash = request.block_hashes[boundary // unit - 1]
        self.block_pool.cache_partial_block(table[index], block_hash, boundary, self.group_id)


def _align_hit(
    per_group: list[list[KVCacheBlock]], num_hit_tokens: int, alignment: int, block_size: int
) -> HitResult:
    """Round the hit down to ``alignment`` tokens and trim the block lists to match."""
    remainder = num_hit_tokens % alignment
    if remainder:
        num_hit_tokens -= remainder
        num_blocks = cdiv(num_hit_tokens, block_size)
        for found in per_group:
            del found[num_blocks:]
    return per_group, num_hit_tokens
