"""Per-group managers (reference §5.4-§5.5): hit searches, skipped blocks, allocation counts."""

from __future__ import annotations

import pytest

from kvcore import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvcore.block_pool import BlockPool
from kvcore.kv_request import KVRequest
from kvcore.managers import (
    NEVER,
    ChunkedLocalAttentionManager,
    CircularBufferManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
    UnsupportedSpecError,
    make_manager,
    manager_class_for_spec,
    register_manager,
)

ATTN = {"num_kv_heads": 2, "head_size": 8, "dtype": "float16"}


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **ATTN)


def swa(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=window, **ATTN)


def mamba(block_size: int, mode: str, **kwargs) -> MambaSpec:
    return MambaSpec(
        block_size=block_size, shapes=((4,),), dtypes=("float32",), mamba_cache_mode=mode, **kwargs
    )


def manager_for(spec, *, num_blocks=32, hash_block_size=None, alignment=None, pool=None, **kw):
    pool = pool if pool is not None else BlockPool(num_blocks)
    return make_manager(
        spec,
        pool,
        0,
        hash_block_size=hash_block_size or spec.block_size,
        cache_hit_alignment=alignment or spec.block_size,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64),
        max_model_len=kw.pop("max_model_len", 1024),
        **kw,
    )


def admit(manager, request: KVRequest, num_tokens: int, hit=(), num_hit_tokens=0):
    """First allocation of ``request``: take its hit, then room for ``num_tokens`` tokens."""
    manager.add_hit_blocks(request.request_id, list(hit), num_hit_tokens)
    return manager.allocate_new_blocks(request.request_id, num_tokens)


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def table_ids(manager, request_id: str) -> list[int]:
    return ids(manager.req_to_blocks[request_id])


def prompt(num_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_tokens))


# ----- full attention -----------------------------------------------------------------


def test_full_attention_fine_grained_hit_ends_inside_a_block():
    """§5.5: bs 64, hash unit 16, 150-token prompt: max length 149, phase 1 covers 2 blocks
    (128 tokens), phase 2 finds hash unit 8 (tokens 0-143) cached: hit 144."""
    manager = manager_for(full(64), hash_block_size=16, alignment=16)
    first = KVRequest("a", prompt(150), hash_block_size=16)
    assert ids(admit(manager, first, 150)) == [1, 2, 3]
    manager.cache_blocks(first, 150)
    assert manager.block_pool.blocks[3].hash_num_tokens == 144  # the prompt-tail key
    probe = KVRequest("b", prompt(150), hash_block_size=16)
    (found,), num_tokens = manager.find_longest_cache_hit(probe.block_hashes, 149, [0])
    assert (ids(found), num_tokens) == ([1, 2, 3], 144)
    # The same cache seen at whole-block alignment stops after phase 1.
    coarse = manager_for(full(64), hash_block_size=16, pool=manager.block_pool)
    (found,), num_tokens = coarse.find_longest_cache_hit(probe.block_hashes, 149, [0])
    assert (ids(found), num_tokens) == ([1, 2], 128)


def test_full_attention_fine_grained_probe_needs_the_same_tail_tokens():
    manager = manager_for(full(64), hash_block_size=16, alignment=16)
    first = KVRequest("a", prompt(150), hash_block_size=16)
    admit(manager, first, 150)
    manager.cache_blocks(first, 150)
    tokens = prompt(150)
    tokens[140] = 9999  # inside hash unit 8
    probe = KVRequest("b", tokens, hash_block_size=16)
    (found,), num_tokens = manager.find_longest_cache_hit(probe.block_hashes, 149, [0])
    assert (ids(found), num_tokens) == ([1, 2], 128)


def test_full_attention_hit_stops_at_the_first_miss():
    manager = manager_for(full(16))
    first = KVRequest("a", prompt(64), hash_block_size=16)
    admit(manager, first, 64)
    manager.cache_blocks(first, 64)
    manager.block_pool.evict_blocks([2])  # position 1
    (found,), num_tokens = manager.find_longest_cache_hit(first.block_hashes, 63, [0])
    assert (ids(found), num_tokens) == ([1], 16)


def test_full_attention_reports_new_blocks_for_zeroing_when_asked():
    manager = manager_for(full(16), needs_zeroing=True)
    admit(manager, KVRequest("a", prompt(40), hash_block_size=16), 40)
    assert manager.take_new_block_ids() == [1, 2, 3]
    assert manager.take_new_block_ids() == []
    quiet = manager_for(full(16))
    admit(quiet, KVRequest("a", prompt(40), hash_block_size=16), 40)
    assert quiet.take_new_block_ids() == []


def test_free_returns_blocks_tail_first():
    manager = manager_for(full(16), num_blocks=6)
    request = KVRequest("a", prompt(40), hash_block_size=16)
    admit(manager, request, 40)
    manager.cache_blocks(request, 40)  # blocks 1, 2 cached; 3 holds 8 tokens
    manager.free("a")
    assert ids(manager.block_pool.free_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1]
    manager.free("a")  # unknown requests are ignored
    assert manager.block_pool.num_free_blocks == 5


# ----- sliding window -----------------------------------------------------------------


def test_sliding_window_skipped_tokens():
    manager = manager_for(swa(16, 4))
    assert manager.num_skipped_tokens(7) == 4  # §5.5: W=4, n=7
    assert manager.num_skipped_tokens(3) == 0
    extra = manager_for(
        SlidingWindowSpec(block_size=16, sliding_window=4, extra_retained_tokens=2, **ATTN)
    )
    assert extra.num_skipped_tokens(7) == 2


def test_sliding_window_allocation_counts_new_and_evictable_hit_blocks():
    """§5.5: W=4096, bs=16, 8,192 tokens hit and 512 new: required 544, skipped 256 blocks,
    512 hit positions: 32 new blocks, plus the hit blocks that sit in the free queue."""
    manager = manager_for(swa(16, 4096), num_blocks=600)
    pool = manager.block_pool
    window_blocks = pool.get_new_blocks(256)  # held by another request
    hit = [pool.null_block] * 256 + window_blocks
    assert manager.num_skipped_tokens(8192) // 16 == 256
    assert manager.num_blocks_to_allocate("r", 8192 + 512, hit, 8192) == 32
    pool.free_blocks(window_blocks)  # now eviction candidates
    assert manager.num_blocks_to_allocate("r", 8192 + 512, hit, 8192) == 32 + 256


def cached_window_manager(window: int, num_tokens: int, alignment: int = 16):
    manager = manager_for(swa(16, window), alignment=alignment)
    request = KVRequest("seed", prompt(num_tokens), hash_block_size=16)
    admit(manager, request, num_tokens)
    manager.cache_blocks(request, num_tokens)
    return manager, request.block_hashes


def test_sliding_window_search_takes_the_rightmost_full_window():
    manager, hashes = cached_window_manager(32, 161)  # positions 0-9 are blocks 1-10
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 160, [0])
    assert (ids(found), num_tokens) == ([0] * 8 + [9, 10], 160)
    manager.block_pool.evict_blocks([10])  # position 9
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 160, [0])
    assert (ids(found), num_tokens) == ([0] * 7 + [8, 9], 144)
    manager.block_pool.evict_blocks([8])  # position 7: a miss resets the run
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 160, [0])
    assert (ids(found), num_tokens) == ([0] * 5 + [6, 7], 112)


def test_sliding_window_run_starts_only_on_an_aligned_block_end():
    manager, hashes = cached_window_manager(32, 161, alignment=32)
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 160, [0])
    assert num_tokens == 160
    manager.block_pool.evict_blocks([10])  # position 9; position 8 ends at 144, unaligned
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 160, [0])
    assert (ids(found), num_tokens) == ([0] * 6 + [7, 8], 128)


def test_sliding_window_without_a_full_window_keeps_the_leading_run():
    manager, hashes = cached_window_manager(64, 97)  # needs 4 contiguous blocks
    manager.block_pool.evict_blocks([3])  # position 2: runs are [0, 1] and [3, 4, 5]
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 96, [0])
    assert (ids(found), num_tokens) == ([1, 2], 32)


def test_sliding_window_frees_blocks_that_leave_the_window():
    manager = manager_for(swa(16, 32), num_blocks=8)
    request = KVRequest("a", prompt(80), hash_block_size=16)
    admit(manager, request, 80)
    manager.cache_blocks(request, 80)
    manager.remove_skipped_blocks("a", 80)  # 80 - 31 = 49 tokens skipped: 3 blocks
    assert table_ids(manager, "a") == [0, 0, 0, 4, 5]
    assert ids(manager.block_pool.free_queue.get_all_free_blocks()) == [6, 7, 3, 2, 1]
    manager.remove_skipped_blocks("a", 81)
    assert table_ids(manager, "a") == [0, 0, 0, 4, 5]
    manager.remove_skipped_blocks("a", 96)  # 65 skipped: one more
    assert table_ids(manager, "a") == [0, 0, 0, 0, 5]
    assert manager.next_skip_tokens("a", 96) == 5 * 16 + 31


def test_sliding_window_admission_cap_matches_the_pool_sizer():
    spec = swa(16, 32)
    manager = manager_for(spec, max_num_batched_tokens=64, max_model_len=1024)
    assert manager.max_admission_blocks == spec.max_admission_blocks_per_request(64, 1024) == 7
    assert manager.num_blocks_to_allocate("r", 1000, (), 0) == 63
    assert manager.num_blocks_to_allocate("r", 1000, (), 0, apply_admission_cap=True) == 7


def test_sliding_window_first_allocation_drops_the_hit_blocks_out_of_the_window():
    manager, hashes = cached_window_manager(32, 161)
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 160, [0])
    request = KVRequest("b", prompt(170), hash_block_size=16)
    appended = admit(manager, request, 170, found, num_tokens)
    assert table_ids(manager, "b") == [0] * 8 + [9, 10, 12]
    assert ids(appended) == [12]
    assert manager.block_pool.blocks[9].ref_cnt == 2  # the seed and "b" share it


# ----- chunked local ------------------------------------------------------------------


def chunked_manager(num_tokens: int):
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN)
    manager = manager_for(spec)
    request = KVRequest("seed", prompt(num_tokens), hash_block_size=4)
    admit(manager, request, num_tokens)
    manager.cache_blocks(request, num_tokens)
    return manager, request.block_hashes


def test_chunked_local_skips_whole_chunks():
    manager, _ = chunked_manager(20)
    assert [manager.num_skipped_tokens(n) for n in (7, 8, 15, 16)] == [0, 8, 8, 16]


def test_chunked_local_search_marks_earlier_chunks_null():
    """§5.5: chunk 8, bs 4: max length 15 gives [null, null, block 2?]; 16 gives 4 nulls."""
    manager, hashes = chunked_manager(20)  # positions 0-4 are blocks 1-5
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 15, [0])
    assert (ids(found), num_tokens) == ([0, 0, 3], 12)
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 16, [0])
    assert (ids(found), num_tokens) == ([0, 0, 0, 0], 16)
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 20, [0])
    assert (ids(found), num_tokens) == ([0, 0, 0, 0, 5], 20)
    manager.block_pool.evict_blocks([3])
    (found,), num_tokens = manager.find_longest_cache_hit(hashes, 15, [0])
    assert (ids(found), num_tokens) == ([0, 0], 8)


def test_chunked_local_refuses_a_hit_alignment_other_than_its_block():
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN)
    with pytest.raises(ValueError, match="not compatible with chunked local attention"):
        manager_for(spec, alignment=8)


# ----- Mamba --------------------------------------------------------------------------


def test_mamba_none_holds_one_state_block_and_never_hits():
    manager = manager_for(mamba(16, "none"))
    request = KVRequest("a", prompt(100), hash_block_size=16)
    assert manager.num_blocks_to_allocate("a", 100, (), 0) == 1
    assert ids(admit(manager, request, 100)) == [1]
    assert manager.num_blocks_to_allocate("a", 900, (), 100) == 0
    assert manager.allocate_new_blocks("a", 900) == []
    manager.cache_blocks(request, 96)
    assert len(manager.block_pool.cached_blocks) == 0
    assert manager.find_longest_cache_hit(request.block_hashes, 99, [0]) == ([[]], 0)
    assert manager.capacity_tokens("a") == NEVER


def test_mamba_speculative_blocks_in_none_mode():
    manager = manager_for(mamba(16, "none", num_speculative_blocks=2))
    assert ids(admit(manager, KVRequest("a", prompt(5), hash_block_size=16), 5)) == [1, 2, 3]


def test_mamba_align_keeps_the_latest_state_and_frees_the_previous_one_a_step_later():
    manager = manager_for(mamba(16, "align"), num_blocks=8)
    request = KVRequest("a", prompt(60), hash_block_size=16)
    assert manager.num_blocks_to_allocate("a", 32, (), 0) == 1
    assert ids(admit(manager, request, 32)) == [0, 1]  # chunk [0, 32): state at position 1
    manager.cache_blocks(request, 32)
    manager.remove_skipped_blocks("a", 32)
    assert ids(manager.allocate_new_blocks("a", 40)) == [2]  # chunk [32, 40): copy 1 -> 2
    manager.cache_blocks(request, 40)  # 40 is not a block boundary: nothing cached
    manager.remove_skipped_blocks("a", 40)  # the copy out of block 1 has run
    assert table_ids(manager, "a") == [0, 0, 2]
    assert manager.block_pool.blocks[1].ref_cnt == 0
    assert manager.block_pool.blocks[1].block_hash is not None  # still a cache candidate
    assert manager.allocate_new_blocks("a", 48) == []
    manager.cache_blocks(request, 48)
    assert manager.block_pool.blocks[2].hash_num_tokens == 48
    (found,), num_tokens = manager.find_longest_cache_hit(request.block_hashes, 59, [0])
    assert (ids(found), num_tokens) == ([0, 0, 2], 48)
    (found,), num_tokens = manager.find_longest_cache_hit(request.block_hashes, 47, [0])
    assert (ids(found), num_tokens) == ([0, 1], 32)


def test_mamba_align_pads_nulls_when_a_step_jumps_several_positions():
    manager = manager_for(mamba(16, "align"))
    request = KVRequest("a", prompt(100), hash_block_size=16)
    admit(manager, request, 32)
    assert ids(manager.allocate_new_blocks("a", 80)) == [0, 0, 2]
    manager.remove_skipped_blocks("a", 80)
    assert table_ids(manager, "a") == [0, 0, 0, 0, 2]


def test_mamba_align_checkpoints_every_boundary_a_step_crosses():
    manager = manager_for(mamba(16, "align", num_prefill_checkpoint_blocks=8))
    request = KVRequest("a", prompt(100), hash_block_size=16)
    assert manager.num_blocks_to_allocate("a", 70, (), 0) == 5
    assert ids(admit(manager, request, 70)) == [1, 2, 3, 4, 5]  # states at 16, 32, 48, 64, 70
    manager.remove_skipped_blocks("a", 70)  # nothing is cached yet: every checkpoint stays
    assert table_ids(manager, "a") == [1, 2, 3, 4, 5]
    manager.cache_blocks(request, 70)
    assert [manager.block_pool.blocks[i].hash_num_tokens for i in (1, 2, 3, 4)] == [16, 32, 48, 64]
    assert manager.block_pool.blocks[5].block_hash is None  # 70 is inside position 4
    manager.remove_skipped_blocks("a", 70)
    assert table_ids(manager, "a") == [0, 0, 0, 0, 5]
    assert manager.block_pool.num_free_blocks == 31 - 1  # the freed checkpoints stay cached
    # A later step crossing 80 writes the state at 80 into block 5 (its copy source) first.
    assert manager.num_blocks_to_allocate("a", 90, (), 70) == 1
    assert ids(manager.allocate_new_blocks("a", 90)) == [6]
    manager.cache_blocks(request, 90)
    assert manager.block_pool.blocks[5].hash_num_tokens == 80
    (found,), num_tokens = manager.find_longest_cache_hit(request.block_hashes, 99, [0])
    assert (ids(found), num_tokens) == ([0, 0, 0, 0, 5], 80)
    (found,), num_tokens = manager.find_longest_cache_hit(request.block_hashes, 40, [0])
    assert (ids(found), num_tokens) == ([0, 2], 32)


def test_mamba_align_checkpoints_are_capped_to_the_latest_boundaries():
    manager = manager_for(mamba(16, "align", num_prefill_checkpoint_blocks=2))
    request = KVRequest("a", prompt(100), hash_block_size=16)
    assert manager.num_blocks_to_allocate("a", 80, (), 0) == 3
    assert ids(admit(manager, request, 80)) == [0, 0, 1, 2, 3]


def test_mamba_align_checkpoints_wait_for_the_cache_before_leaving():
    # Asynchronous scheduling allocates the next step before the last one's result arrives.
    manager = manager_for(mamba(16, "align", num_prefill_checkpoint_blocks=4))
    request = KVRequest("a", prompt(100), hash_block_size=16)
    admit(manager, request, 40)
    manager.remove_skipped_blocks("a", 40)
    assert manager.next_skip_tokens("a", 40) <= 40  # still due: looked at again next step
    assert table_ids(manager, "a") == [1, 2, 3]
    manager.cache_blocks(request, 40)
    manager.remove_skipped_blocks("a", 40)
    assert table_ids(manager, "a") == [0, 0, 3]


def test_mamba_align_first_allocation_from_a_hit_copies_the_hit_state():
    manager = manager_for(mamba(16, "align"))
    seed = KVRequest("seed", prompt(64), hash_block_size=16)
    admit(manager, seed, 48)
    manager.cache_blocks(seed, 48)
    manager.free("seed")
    request = KVRequest("b", prompt(64), hash_block_size=16)
    (found,), num_tokens = manager.find_longest_cache_hit(request.block_hashes, 63, [0])
    assert (ids(found), num_tokens) == ([0, 0, 1], 48)
    assert manager.num_blocks_to_allocate("b", 64, found, 48) == 2  # new + evictable hit
    assert ids(admit(manager, request, 64, found, 48)) == [2]
    assert table_ids(manager, "b") == [0, 0, 1, 2]
    manager.remove_skipped_blocks("b", 64)
    assert table_ids(manager, "b") == [0, 0, 0, 2]


def test_mamba_unsupported_modes_are_refused():
    with pytest.raises(ValueError, match="'all' is not supported"):
        manager_for(mamba(16, "all"))


def test_mamba_align_draft_blocks_sit_beside_the_table_for_the_request_life():
    """Speculating, an align request holds 2 draft blocks from its first allocation to its
    end: counted when it is admitted, never in its table or the prefix cache."""
    manager = manager_for(mamba(16, "align", num_speculative_blocks=2))
    request = KVRequest("a", prompt(40), hash_block_size=16)
    assert manager.num_blocks_to_allocate("a", 20, (), 0) == 1 + 2
    assert ids(admit(manager, request, 20)) == [0, 3]  # the table: drafts claimed first
    assert manager.draft_block_ids("a") == [1, 2] and table_ids(manager, "a") == [0, 3]
    assert manager.num_blocks_to_allocate("a", 40, (), 20) == 1  # drafts already held
    assert ids(manager.allocate_new_blocks("a", 40)) == [4]
    assert manager.draft_block_ids("a") == [1, 2]
    manager.cache_blocks(request, 32)
    cached = {block.block_id for _, block in manager.block_pool.cached_blocks.iter_blocks()}
    assert cached == {3} and not {1, 2} & cached
    free_before = manager.block_pool.num_free_blocks
    manager.free("a")
    assert manager.draft_block_ids("a") == []
    assert manager.block_pool.num_free_blocks == free_before + 4


def test_mamba_blocks_are_not_reported_for_zeroing():
    manager = manager_for(mamba(16, "align"), needs_zeroing=True)
    admit(manager, KVRequest("a", prompt(20), hash_block_size=16), 20)
    assert manager.take_new_block_ids() == []


# ----- circular buffer ----------------------------------------------------------------


def test_circular_buffer_holds_one_block_never_cached_never_zeroed():
    spec = CircularBufferSpec(
        block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype="bfloat16"
    )
    manager = manager_for(spec, needs_zeroing=True)
    request = KVRequest("a", prompt(50), hash_block_size=4)
    assert manager.num_blocks_to_allocate("a", 50, (), 0) == 1
    assert ids(admit(manager, request, 50)) == [1]
    assert manager.num_blocks_to_allocate("a", 500, (), 50) == 0
    assert manager.allocate_new_blocks("a", 500) == []
    manager.cache_blocks(request, 48)
    manager.remove_skipped_blocks("a", 48)
    assert table_ids(manager, "a") == [1]
    assert len(manager.block_pool.cached_blocks) == 0
    assert manager.take_new_block_ids() == []
    assert manager.find_longest_cache_hit(request.block_hashes, 49, [0]) == ([[]], 0)


# ----- registry -----------------------------------------------------------------------


def test_registry_walks_the_spec_mro():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")
    swa_mla = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16", sliding_window=8
    )
    ring = CircularBufferSpec(block_size=4, **ATTN)
    chunked = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN)
    assert manager_class_for_spec(full(16)) is FullAttentionManager
    assert manager_class_for_spec(mla) is FullAttentionManager
    assert manager_class_for_spec(swa(16, 8)) is SlidingWindowManager
    assert manager_class_for_spec(swa_mla) is SlidingWindowManager
    assert manager_class_for_spec(ring) is CircularBufferManager
    assert manager_class_for_spec(chunked) is ChunkedLocalAttentionManager
    assert manager_class_for_spec(mamba(16, "none")) is MambaManager


def test_a_uniform_group_is_managed_as_its_first_member():
    wrapper = UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={
            "a": swa(16, 32),
            "b": SlidingWindowSpec(
                block_size=16, sliding_window=32, num_kv_heads=4, head_size=8, dtype="float16"
            ),
        },
    )
    manager = manager_for(wrapper)
    assert isinstance(manager, SlidingWindowManager)
    assert manager.sliding_window == 32 and manager.max_admission_blocks == 7


def test_unregistered_specs_are_refused_and_conflicts_detected():
    with pytest.raises(
        UnsupportedSpecError, match="No manager found for KV cache spec type AttentionSpec"
    ):
        manager_class_for_spec(AttentionSpec(block_size=16, **ATTN))
    register_manager(FullAttentionSpec, FullAttentionManager)  # the same entry is fine
    with pytest.raises(ValueError, match="Conflicting registration"):
        register_manager(FullAttentionSpec, SlidingWindowManager)
