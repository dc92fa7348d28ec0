"""Sliding-window attention: a token attends to the last ``sliding_window`` tokens (itself
included) plus ``extra_retained_tokens``, so older blocks go back to the pool."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._math import cdiv
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.managers.base import GroupManager, HitResult
from kvcore.managers.full_attention import _align_hit


class SlidingWindowManager(GroupManager):
    """A hit needs only the ``cdiv(W - 1, block_size)`` blocks before its end: every other
    position is the null block. Blocks that fall out of the window are freed (they stay in the
    prefix cache until evicted) and become null in the table."""

    frees_blocks_early = True

    def __init__(self, spec, block_pool, group_id, **kwargs) -> None:
        super().__init__(spec, block_pool, group_id, **kwargs)
        self.sliding_window: int = self.spec.sliding_window
        self.extra_retained_tokens: int = self.spec.extra_retained_tokens
        # -1: the token being computed is itself inside the window.
        self.num_window_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)

    def next_skip_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        num_skipped_blocks = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        return (
            (num_skipped_blocks + 1) * self.block_size
            + self.sliding_window
            - 1
            + self.extra_retained_tokens
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> HitResult:
        """Search right to left for ``num_window_blocks`` contiguous cached blocks; a run may
        only start (at its right end) on a block whose end is aligned. Without such a run, a
        shorter run reaching position 0 is still a hit."""
        block_size = self.block_size
        alignment = self.cache_hit_alignment
        hashes = self._block_hashes(block_hashes)
        num_max_blocks = min(max_length // block_size, len(hashes))
        per_group: list[list[KVCacheBlock]] = [
            [self.null_block] * num_max_blocks for _ in group_ids
        ]
        pool = self.block_pool
        run = 0
        for index in range(num_max_blocks - 1, -1, -1):
            blocks = pool.get_cached_blocks(hashes[index], group_ids)
            if blocks is None:
                run = 0
                continue
            if run == 0 and (index + 1) * block_size % alignment:
                continue
            for found, block in zip(per_group, blocks, strict=True):
                found[index] = block
            run += 1
            if run >= self.num_window_blocks:
                # Trim what lies right of the run, e.g. [N, N, 8, 3, N, 9] -> [N, N, 8, 3].
                for found in per_group:
                    del found[index + run :]
                return per_group, (index + run) * block_size
        for found in per_group:
            del found[run:]
        return _align_hit(per_group, run * block_size, alignment, block_size)
