"""The free queue and the block pool (reference §5.2-§5.3), on an 11-block pool."""

from __future__ import annotations

import logging

import pytest

from kvcore.block_pool import BlockPool, CachedBlockMap
from kvcore.free_block_queue import FreeBlockQueue, KVCacheBlock, NoFreeBlocksError
from kvcore.hashing import hash_token_ids

HASHES = hash_token_ids(list(range(64)), 16)  # 4 chained block hashes


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_queue.get_all_free_blocks())


# ----- free queue ---------------------------------------------------------------------


def test_queue_starts_in_block_id_order_and_pops_from_the_front():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3]
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert (queue.num_free_blocks, ids(queue.get_all_free_blocks())) == (1, [3])
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_queue_remove_is_a_constant_time_unlink_anywhere():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="remove\\(\\) called on an invalid block"):
        queue.remove(blocks[2])


def test_queue_append_n_and_prepend_n_keep_the_given_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks[:2])
    queue.append_n([blocks[2], blocks[3]])
    queue.prepend_n([blocks[4], blocks[5]])
    assert ids(queue.get_all_free_blocks()) == [4, 5, 0, 1, 2, 3]
    assert queue.num_free_blocks == 6


def test_queue_refuses_to_pop_more_than_it_has():
    queue = FreeBlockQueue([KVCacheBlock(0)])
    queue.popleft()
    with pytest.raises(NoFreeBlocksError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(NoFreeBlocksError):
        queue.popleft_n(1)


def test_block_hash_is_set_once():
    block = KVCacheBlock(3)
    block.set_block_hash(b"k", 16)
    with pytest.raises(RuntimeError, match="already has a hash"):
        block.set_block_hash(b"k2", 32)
    block.reset_hash()
    assert (block.block_hash, block.hash_num_tokens) == (None, 0)


# ----- prefix map ---------------------------------------------------------------------


def test_prefix_map_keeps_duplicates_and_pops_by_block_id():
    blocks = [KVCacheBlock(i) for i in range(3)]
    cached = CachedBlockMap()
    cached.insert(b"key", blocks[1])
    cached.insert(b"key", blocks[2])
    assert len(cached) == 1
    assert sorted(ids(block for _, block in cached.iter_blocks())) == [1, 2]
    assert cached.get_one(b"key") in (blocks[1], blocks[2])
    assert cached.pop(b"key", 0) is None
    assert cached.pop(b"key", 1) is blocks[1]
    assert cached.get_one(b"key") is blocks[2]
    assert cached.pop(b"key", 2) is blocks[2]
    assert cached.get_one(b"key") is None and len(cached) == 0


# ----- pool ---------------------------------------------------------------------------


def test_null_block_is_block_zero_and_is_never_handed_out():
    pool = BlockPool(11)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.num_free_blocks == 10 and pool.usage == 0.0
    assert ids(pool.get_new_blocks(10)) == list(range(1, 11))
    assert pool.usage == 1.0
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.num_free_blocks == 0


def test_get_new_blocks_refuses_more_than_the_free_blocks():
    pool = BlockPool(11)
    with pytest.raises(NoFreeBlocksError, match="Cannot get 11 free blocks from the pool"):
        pool.get_new_blocks(11)
    assert pool.num_free_blocks == 10


def test_usage_counts_only_usable_blocks():
    pool = BlockPool(11)
    pool.get_new_blocks(4)
    assert pool.usage == pytest.approx(0.4)


def test_freed_hashed_blocks_go_to_the_back_and_unhashed_to_the_front():
    pool = BlockPool(11)
    blocks = pool.get_new_blocks(4)  # ids 1..4
    pool.cache_full_blocks(blocks, HASHES, 0, 3, 16, 0)  # 1..3 cached, 4 partial
    pool.free_blocks(reversed(blocks))  # a request frees its tail first
    # Block 4 (never hashed) is reused first; then the untouched 5..10; then the cached
    # chain tail first: 3, 2, 1.
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]


def test_with_caching_off_every_freed_block_goes_to_the_back():
    pool = BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]


def test_eviction_follows_the_queue_and_drops_the_keys():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, HASHES, 0, 4, 16, 0)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert ids(pool.get_new_blocks(1)) == [4]
    assert pool.get_cached_block(HASHES[3], 0) is None
    assert pool.get_cached_block(HASHES[2], 0) is pool.blocks[3]
    assert pool.blocks[4].block_hash is None and pool.num_evictions == 1


def test_touch_takes_a_cached_free_block_off_the_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2, 16, 0)
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(HASHES[0], 0)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and 1 not in free_ids(pool)
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.free_blocks([hit, hit])
    assert hit.ref_cnt == 0 and free_ids(pool)[-1] == 1


def test_freeing_more_often_than_taken_is_an_error():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([block])


def test_keys_carry_the_group_id():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks[:1], HASHES, 0, 1, 16, 0)
    pool.cache_full_blocks(blocks[1:], HASHES, 0, 1, 16, 1)
    assert pool.get_cached_block(HASHES[0], 0) is blocks[0]
    assert pool.get_cached_block(HASHES[0], 1) is blocks[1]
    assert pool.get_cached_blocks(HASHES[0], [0, 1]) == blocks
    assert pool.get_cached_blocks(HASHES[0], [0, 2]) is None


def test_duplicate_blocks_for_one_prefix_stay_cached_independently():
    pool = BlockPool(6)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], HASHES, 0, 1, 16, 0)
    pool.cache_full_blocks([second], HASHES, 0, 1, 16, 0)  # same prefix, computed twice
    assert first.block_hash == second.block_hash
    pool.free_blocks([first, second])  # queue: 3 4 5 1 2
    pool.get_new_blocks(4)  # evicts block 1
    assert first.block_hash is None
    assert pool.get_cached_block(HASHES[0], 0) is second


def test_cache_full_blocks_skips_null_and_cached_blocks_and_promotes_partial_keys():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.cache_partial_block(blocks[1], HASHES[0], 16, 0)
    table = [pool.null_block, *blocks]
    pool.cache_full_blocks(table, hash_token_ids(list(range(48)), 16), 0, 3, 16, 0)
    assert pool.null_block.block_hash is None
    assert blocks[1].hash_num_tokens == 48  # promoted from the 16-token partial key
    assert pool.get_cached_block(HASHES[0], 0) is None
    assert len(pool.cached_blocks) == 2


def test_partial_keys_replace_shorter_ones_and_keep_longer_ones():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_partial_block(block, HASHES[0], 16, 0)
    assert pool.cache_partial_block(block, HASHES[1], 32, 0)
    assert not pool.cache_partial_block(block, HASHES[0], 16, 0)
    assert pool.get_cached_block(HASHES[1], 0) is block
    assert pool.get_cached_block(HASHES[0], 0) is None
    assert not pool.cache_partial_block(pool.null_block, HASHES[0], 16, 0)


def test_evict_blocks_drops_keys_but_keeps_blocks_in_use():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2, 16, 0)
    pool.evict_blocks([1])
    assert blocks[0].block_hash is None and blocks[0].ref_cnt == 1
    assert pool.get_cached_block(HASHES[1], 0) is blocks[1]
    with pytest.raises(ValueError, match="outside the pool"):
        pool.evict_blocks([4])


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(caplog):
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2, 16, 0)
    with caplog.at_level(logging.WARNING):
        assert not pool.reset_prefix_cache()
    assert "some blocks (2) are not freed yet" in caplog.text
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert len(pool.cached_blocks) == 0
    assert all(block.block_hash is None for block in pool.blocks)
