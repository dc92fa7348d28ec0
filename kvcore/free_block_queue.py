"""The KV-cache block and the free queue: an intrusive doubly linked list with O(1) removal.

The front of the queue is reused (and, if it is cached, evicted) first. The pool appends freed
cached blocks at the back, which makes eviction LRU, and puts freed never-hashed blocks at the
front, since they can never produce a hit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class NoFreeBlocksError(ValueError):
    """The pool (or the free queue) has fewer free blocks than were asked for."""


class KVCacheBlock:
    """One block id of the shared pool. Plain slots class: the pool touches these on every step.

    ``block_hash`` is the prefix-map key (hash + group id) while the block is cached, else None;
    ``hash_num_tokens`` is the prefix length that key covers (a partial key may end inside the
    block). ``prev_free`` / ``next_free`` are the free-queue links, both None when the block is
    not in the queue.
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "hash_num_tokens",
        "is_null",
        "next_free",
        "prev_free",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.hash_num_tokens = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def set_block_hash(self, key: bytes, num_tokens: int) -> None:
        if self.block_hash is not None:
            raise RuntimeError("The block already has a hash. This should not happen.")
        self.block_hash = key
        self.hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self.block_hash = None
        self.hash_num_tokens = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Free blocks in reuse order, initially by block id. Sentinels at both ends keep every
    link operation branch-free."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        chain = [self._head, *blocks, self._tail]
        for left, right in itertools.pairwise(chain):
            left.next_free = right
            right.prev_free = left

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise NoFreeBlocksError("No free blocks available")
        if block is None or block.next_free is None:
            raise RuntimeError("The free block queue is corrupted: a broken link at the front.")
        self._head.next_free = block.next_free
        block.next_free.prev_free = self._head
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"Cannot pop {num_blocks} blocks from a queue of {self.num_free_blocks}"
            )
        popped = []
        block = self._head.next_free
        for _ in range(num_blocks):
            following = block.next_free
            block.prev_free = block.next_free = None
            popped.append(block)
            block = following
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= num_blocks
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` wherever it is (a cached block taken back by a prefix hit)."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add ``blocks`` at the back, in order: the first of them is evicted first."""
        self._link_after(self._tail.prev_free, blocks)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add ``blocks`` at the front, in order: the first of them is reused first."""
        self._link_after(self._head, blocks)

    def _link_after(self, anchor: KVCacheBlock, blocks: Iterable[KVCacheBlock]) -> None:
        after = anchor.next_free
        count = 0
        for block in blocks:
            anchor.next_free = block
            block.prev_free = anchor
            anchor = block
            count += 1
        anchor.next_free = after
        after.prev_free = anchor
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front to back (for tests and checks; O(n))."""
        blocks = []
        block = self._head.next_free
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks
