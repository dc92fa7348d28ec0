"""The block pool shared by every KV-cache group: free queue, ref counts and the prefix map.

Block 0 is the null block: it stands for "no block here" in block tables (a position that fell
out of a sliding window, a Mamba position that holds no state). It is taken out at construction,
is never handed out, freed, touched or cached, and its ref count stays 0. So ``num_blocks - 1``
blocks are usable.

A block is in the free queue iff its ref count is 0. A cached block (one with a hash) stays
cached while it sits in the free queue, so a later request can take it back (``touch``); it
loses its hash only when the queue hands it out again (eviction) or the cache is reset.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from kvcore.free_block_queue import FreeBlockQueue, KVCacheBlock, NoFreeBlocksError
from kvcore.hashing import GROUP_ID_NUM_BYTES, BlockHash

logger = logging.getLogger(__name__)


class CachedBlockMap:
    """Prefix-map key -> cached block. Duplicates are allowed: two requests that computed the
    same prefix at once both keep their own block (block tables are append-only, so nothing
    is deduplicated); such a key maps to ``{block_id: block}``."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one(self, key: bytes) -> KVCacheBlock | None:
        entry = self._entries.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = block
        elif type(entry) is KVCacheBlock:
            self._entries[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove ``block_id`` under ``key`` (and nothing else); None if it is not there."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id != block_id:
                return None
            del self._entries[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._entries[key] = next(iter(entry.values()))
        return block

    def iter_blocks(self) -> Iterator[tuple[bytes, KVCacheBlock]]:
        """Every (key, block) pair, duplicates included."""
        for key, entry in self._entries.items():
            if type(entry) is KVCacheBlock:
                yield key, entry
            else:
                for block in entry.values():
                    yield key, block

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class BlockPool:
    """``num_blocks`` blocks (the null block included) shared by every KV-cache group."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"A block pool needs at least the null block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks = CachedBlockMap()
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        # Bumped whenever a cached block loses its hash, so a stale cache hit can be detected.
        self.num_evictions = 0
        self._group_suffixes: list[bytes] = []

    # ----- lookups -----------------------------------------------------------------------

    def group_suffix(self, group_id: int) -> bytes:
        suffixes = self._group_suffixes
        while len(suffixes) <= group_id:
            suffixes.append(len(suffixes).to_bytes(GROUP_ID_NUM_BYTES, "big"))
        return suffixes[group_id]

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self.cached_blocks.get_one(block_hash + self.group_suffix(group_id))

    def get_cached_blocks(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        found = []
        for group_id in group_ids:
            block = self.cached_blocks.get_one(block_hash + self.group_suffix(group_id))
            if block is None:
                return None
            found.append(block)
        return found

    # ----- caching -----------------------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes[i]``
        (hashes already at ``block_size`` granularity). Null blocks are skipped; a block with
        a shorter (partial) key is promoted to the full key."""
        if num_cached_blocks >= num_full_blocks:
            return
        suffix = self.group_suffix(group_id)
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            num_tokens = (index + 1) * block_size
            if block.block_hash is not None:
                if block.hash_num_tokens >= num_tokens:
                    continue  # a prefix-cache hit: already cached under this key
                self.cached_blocks.pop(block.block_hash, block.block_id)
                block.reset_hash()
            key = block_hashes[index] + suffix
            block.set_block_hash(key, num_tokens)
            self.cached_blocks.insert(key, block)

    def cache_partial_block(
        self, block: KVCacheBlock, block_hash: BlockHash, num_tokens: int, group_id: int
    ) -> bool:
        """Cache ``block`` as holding a prefix of ``num_tokens`` tokens that ends inside it
        (``block_hash`` is the hash of that prefix's last hash unit). An older, shorter key of
        the block is replaced; a longer one is kept. Returns whether the key was inserted."""
        if block.is_null or (block.block_hash is not None and block.hash_num_tokens >= num_tokens):
            return False
        if block.block_hash is not None:
            self.cached_blocks.pop(block.block_hash, block.block_id)
            block.reset_hash()
        key = block_hash + self.group_suffix(group_id)
        block.set_block_hash(key, num_tokens)
        self.cached_blocks.insert(key, block)
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        self.cached_blocks.pop(block.block_hash, block.block_id)
        block.reset_hash()
        self.num_evictions += 1

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached keys of ``block_ids``; blocks in use stay allocated."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} is outside the pool of {self.num_blocks}")
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (returns False) while any block is in use."""
        num_used = self.num_blocks - 1 - self.num_free_blocks
        if num_used > 0:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used,
            )
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.reset_hash()
        self.num_evictions += 1
        return True

    # ----- allocation --------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (evicting their cached
        keys), each with ref count 1."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise NoFreeBlocksError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            if block.ref_cnt != 0:
                raise RuntimeError(f"{block} was in the free queue while in use")
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit). A free cached block
        leaves the free queue, so it can no longer be evicted."""
        queue = self.free_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, first to last. Blocks that reach 0 return to the
        queue: cached ones (or all, with caching off) at the back in the given order, never
        hashed ones at the front, since only cached blocks are worth keeping."""
        to_back: list[KVCacheBlock] = []
        to_front: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if caching and block.block_hash is None:
                    to_front.append(block)
                else:
                    to_back.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"{block} was freed more often than it was taken")
        if to_back:
            self.free_queue.append_n(to_back)
        if to_front:
            self.free_queue.prepend_n(to_front)

    # ----- accounting --------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (null block excluded) that are in use, 0.0 to 1.0."""
        num_usable = self.num_blocks - 1
        if num_usable == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / num_usable
