"""The result of a prefix-cache search, as the scheduler holds it until ``allocate``."""

from __future__ import annotations

from kvcore.block_pool import BlockPool
from kvcore.free_block_queue import KVCacheBlock


class StaleCacheHitError(RuntimeError):
    """A cache hit was used after some of its blocks were evicted: search again right before
    allocating."""


class CacheHit:
    """A cached prefix: ``num_tokens`` tokens, and the blocks holding them in each group.

    ``group_num_tokens`` says, per group, how long a prefix that group found on its own during
    the search (every group must agree on the hit, so one group's miss caps all of them: this
    is how a state group's miss shows)."""

    __slots__ = ("_keys", "_num_evictions", "blocks", "group_num_tokens", "num_tokens")

    def __init__(
        self,
        num_tokens: int,
        blocks: list[list[KVCacheBlock]],
        num_evictions: int = 0,
        group_num_tokens: tuple[int, ...] | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.blocks = blocks
        self._num_evictions = num_evictions
        if group_num_tokens is None:
            group_num_tokens = tuple(num_tokens if group else 0 for group in blocks)
        self.group_num_tokens = group_num_tokens
        self._keys = [[block.block_hash for block in group] for group in blocks]

    @property
    def block_ids(self) -> list[list[int]]:
        return [[block.block_id for block in group] for group in self.blocks]

    def is_valid(self, block_pool: BlockPool) -> bool:
        """Whether every hit block still holds the prefix it held when the hit was found."""
        if block_pool.num_evictions == self._num_evictions:
            return True
        return all(
            block.block_hash is key
            for group, keys in zip(self.blocks, self._keys, strict=True)
            for block, key in zip(group, keys, strict=True)
        )

    def __repr__(self) -> str:
        return f"CacheHit(num_tokens={self.num_tokens}, block_ids={self.block_ids})"
