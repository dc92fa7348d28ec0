"""The coordinator (reference §5.6): variants, prefix hits, eviction order, the hybrid search."""

from __future__ import annotations

import msgspec
import pytest

from kvcore import CircularBufferSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvcore.bench_coordinator import main as bench_main
from kvcore.cache_hit import StaleCacheHitError
from kvcore.coordinator import KVCacheCoordinator
from kvcore.coordinator_hybrid import HybridCoordinator
from kvcore.coordinator_variants import NoPrefixCacheCoordinator, UnitaryCoordinator
from kvcore.hashing import hashes_for_block_size, make_group_key
from kvcore.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvcore.kv_request import KVRequest

ATTN = {"num_kv_heads": 2, "head_size": 8, "dtype": "float16"}
FULL = FullAttentionSpec(block_size=16, **ATTN)
SWA = SlidingWindowSpec(block_size=16, sliding_window=32, **ATTN)
RING = CircularBufferSpec(
    block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype="bfloat16"
)
MAMBA_ALIGN = MambaSpec(
    block_size=16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align"
)
MAMBA_NONE = MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))


def make_config(specs, *, num_blocks=11, max_model_len=512, hash_block_size=16, **sizes):
    groups = [
        KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        layout="LBNHC",
        scheduler_block_size=sizes.get("scheduler_block_size", 16),
        hash_block_size=hash_block_size,
        cache_hit_alignment=sizes.get("cache_hit_alignment", 16),
        max_model_len=max_model_len,
    )


def make_coordinator(specs, *, enable_caching=True, **kwargs) -> KVCacheCoordinator:
    return KVCacheCoordinator.from_config(
        make_config(specs, **kwargs), max_num_batched_tokens=64, enable_caching=enable_caching
    )


def request(request_id: str, tokens, salt: str | None = None) -> KVRequest:
    return KVRequest(request_id, list(tokens), hash_block_size=16, cache_salt=salt)


def run_prefill(coordinator, req: KVRequest, *chunk_ends: int):
    """Allocate and compute ``req``'s prompt from its cache hit, in chunks ending at
    ``chunk_ends`` and then at the prompt end, caching as the engine does."""
    ends = [*chunk_ends, req.num_tokens]
    hit = coordinator.find_longest_cache_hit(req)
    tables = coordinator.allocate(req, ends[0] - hit.num_tokens, hit)
    assert tables is not None
    req.num_computed_tokens = ends[0]
    coordinator.cache_blocks(req, ends[0])
    for end in ends[1:]:
        assert coordinator.allocate(req, end - req.num_computed_tokens) is not None
        req.num_computed_tokens = end
        coordinator.cache_blocks(req, end)
    return hit, tables


def free_ids(coordinator) -> list[int]:
    return [b.block_id for b in coordinator.block_pool.free_queue.get_all_free_blocks()]


COMMON = list(range(48))  # 3 full blocks


# ----- variants -----------------------------------------------------------------------


def test_from_config_picks_the_variant():
    assert type(make_coordinator([FULL])) is UnitaryCoordinator
    assert type(make_coordinator([FULL, SWA])) is HybridCoordinator
    assert type(make_coordinator([FULL, SWA], enable_caching=False)) is NoPrefixCacheCoordinator
    assert type(make_coordinator([], enable_caching=False)) is NoPrefixCacheCoordinator


def test_config_block_sizes_are_checked():
    with pytest.raises(ValueError, match="must equal the block size"):
        make_coordinator([FULL], hash_block_size=8, scheduler_block_size=16)
    with pytest.raises(ValueError, match="not a multiple of group 0's block size"):
        make_coordinator([FULL, SWA], scheduler_block_size=24, hash_block_size=8)
    with pytest.raises(ValueError, match="not a multiple of hash_block_size"):
        make_coordinator([FULL, SWA], scheduler_block_size=16, hash_block_size=32)


def test_no_prefix_cache_never_hits_and_allocates_for_any_number_of_groups():
    coordinator = make_coordinator([FULL, SWA], enable_caching=False, num_blocks=20)
    first = request("a", [*COMMON, 1])
    run_prefill(coordinator, first)
    second = request("b", [*COMMON, 1])
    hit = coordinator.find_longest_cache_hit(second)
    assert (hit.num_tokens, hit.block_ids) == (0, [[], []])
    assert coordinator.allocate(second, 49) == [[9, 10, 11, 12], [13, 14, 15, 16]]
    empty = make_coordinator([], enable_caching=False)
    assert empty.allocate(request("c", [1, 2]), 2) == []


# ----- unitary: prefix hits and eviction order ----------------------------------------


def test_prefix_hits_share_blocks_and_evict_in_lru_order():
    coordinator = make_coordinator([FULL])  # 10 usable blocks
    first = request("a", COMMON + list(range(100, 107)))  # 55 tokens
    hit, tables = run_prefill(coordinator, first)
    assert (hit.num_tokens, tables) == (0, [[1, 2, 3, 4]])
    second = request("b", COMMON + list(range(200, 205)))  # 53 tokens
    hit, tables = run_prefill(coordinator, second)
    assert (hit.num_tokens, hit.block_ids) == (48, [[1, 2, 3]])
    assert tables == [[1, 2, 3, 5]]  # a first allocation returns the whole table
    assert [coordinator.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    coordinator.free(first)
    coordinator.free(second)
    # Never-hashed tails first (last freed first), untouched blocks, then the cached chain
    # tail first.
    assert free_ids(coordinator) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    third = request("c", range(300, 413))  # 113 tokens: 8 blocks, evicts block 3
    assert coordinator.allocate(third, 113) == [[5, 4, 6, 7, 8, 9, 10, 3]]
    fourth = request("d", [*COMMON, 7])
    assert coordinator.find_longest_cache_hit(fourth).block_ids == [[1, 2]]


def test_a_hit_always_leaves_one_token_to_compute():
    coordinator = make_coordinator([FULL])
    run_prefill(coordinator, request("a", COMMON))
    hit = coordinator.find_longest_cache_hit(request("b", COMMON))
    assert (hit.num_tokens, hit.block_ids) == (32, [[1, 2]])
    assert coordinator.find_longest_cache_hit(request("c", [5])).num_tokens == 0


def test_cache_salt_isolates_prefixes():
    coordinator = make_coordinator([FULL])
    run_prefill(coordinator, request("a", [*COMMON, 1], salt="tenant-a"))
    assert coordinator.find_longest_cache_hit(request("b", [*COMMON, 1])).num_tokens == 0
    other_salt = request("c", [*COMMON, 1], salt="tenant-b")
    assert coordinator.find_longest_cache_hit(other_salt).num_tokens == 0
    same_salt = request("d", [*COMMON, 1], salt="tenant-a")
    assert coordinator.find_longest_cache_hit(same_salt).num_tokens == 48


def test_allocation_is_all_or_nothing():
    coordinator = make_coordinator([FULL])
    run_prefill(coordinator, request("a", range(100)))  # 7 of 10 blocks
    big = request("b", range(500, 580))  # 5 blocks
    assert coordinator.allocate(big, 80) is None
    assert coordinator.num_free_blocks == 3
    assert coordinator.get_block_ids(big) == [[]]
    assert coordinator.allocate(big, 48) == [[8, 9, 10]]


def test_decode_takes_a_new_block_only_at_a_block_boundary():
    coordinator = make_coordinator([FULL])
    req = request("a", range(32))
    run_prefill(coordinator, req)
    new_tables = []
    for token in range(17):
        req.append_token_ids([token])
        new_tables.append(coordinator.allocate(req, 1))
        req.num_computed_tokens += 1
        coordinator.cache_blocks(req, req.num_computed_tokens)
    assert new_tables == [[[3]]] + [[[]]] * 15 + [[[4]]]
    assert coordinator.block_pool.blocks[3].block_hash is not None  # filled at 48 tokens
    assert coordinator.block_pool.blocks[4].block_hash is None


def test_preempted_requests_find_their_blocks_again():
    coordinator = make_coordinator([FULL])
    req = request("a", [*COMMON, 1, 2])
    run_prefill(coordinator, req)
    coordinator.free(req)
    req.num_computed_tokens = 0
    hit, tables = run_prefill(coordinator, req)
    assert (hit.num_tokens, tables) == (48, [[1, 2, 3, 4]])


def test_reset_prefix_cache_waits_for_every_block_to_be_free():
    coordinator = make_coordinator([FULL])
    first = request("a", [*COMMON, 1])
    run_prefill(coordinator, first)
    assert not coordinator.reset_prefix_cache()
    coordinator.free(first)
    assert coordinator.reset_prefix_cache()
    assert coordinator.find_longest_cache_hit(request("b", [*COMMON, 1])).num_tokens == 0
    assert coordinator.usage == 0.0


def test_a_hit_evicted_before_allocation_is_refused():
    coordinator = make_coordinator([FULL], num_blocks=6)  # 5 usable
    seed = request("seed", [*COMMON, 1])
    run_prefill(coordinator, seed)
    coordinator.free(seed)  # queue: 4 5 3 2 1
    late = request("late", [*COMMON, 2])
    hit = coordinator.find_longest_cache_hit(late)
    assert hit.block_ids == [[1, 2, 3]]
    assert coordinator.allocate(request("other", range(900, 948)), 48) == [[4, 5, 3]]
    with pytest.raises(StaleCacheHitError):
        coordinator.allocate(late, 1, hit)


def test_allocation_misuse_is_refused():
    coordinator = make_coordinator([FULL], max_model_len=64)
    req = request("a", [*COMMON, 1])
    run_prefill(coordinator, req)
    other = request("b", [*COMMON, 1])
    hit = coordinator.find_longest_cache_hit(other)
    with pytest.raises(ValueError, match="already holds blocks"):
        coordinator.allocate(req, 1, hit)
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        coordinator.allocate(req, 16)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        coordinator.allocate(req, -1)
    stale = request("c", [1, 2, 3])
    stale.num_computed_tokens = 2
    with pytest.raises(ValueError, match="reset it to 0 after a preemption"):
        coordinator.allocate(stale, 1)


def test_admission_cap_bounds_a_windowed_group_reservation():
    coordinator = make_coordinator([FULL, SWA], num_blocks=200, max_model_len=1024)
    req = request("a", range(1000))
    assert coordinator.num_blocks_needed(req, 1000) == 63 + 63
    # SWA: cdiv(min(31 + 64, 1024), 16) + 1 = 7 blocks at once.
    assert coordinator.num_blocks_needed(req, 1000, apply_admission_cap=True) == 63 + 7


# ----- hybrid -------------------------------------------------------------------------


def hybrid_hit_setup(evicted_swa_positions):
    """Full + SWA (bs 16, W=32): a 170-token prompt computed once, then some SWA blocks
    evicted."""
    coordinator = make_coordinator([FULL, SWA], num_blocks=40)
    seed = request("seed", range(170))
    _, (full_ids, swa_ids) = run_prefill(coordinator, seed)
    assert full_ids == list(range(1, 12)) and swa_ids == list(range(12, 23))
    coordinator.free(seed)
    coordinator.block_pool.evict_blocks([swa_ids[i] for i in evicted_swa_positions])
    return coordinator, coordinator.find_longest_cache_hit(request("probe", range(170)))


def test_hybrid_hit_when_the_window_ending_at_the_full_hit_is_cached():
    """§5.6: full attention hits 10 blocks (160); SWA searches from block 9 down; 9 and 8
    are cached, so the hit is 160."""
    coordinator, hit = hybrid_hit_setup([])
    assert coordinator.is_simple
    assert hit.num_tokens == 160
    assert hit.block_ids == [list(range(1, 11)), [0] * 8 + [20, 21]]


def test_hybrid_hit_shrinks_to_the_window_sw_a_has_and_truncates_full_attention():
    """§5.6: only SWA blocks 8 and 7 cached: the hit is 144 and full attention keeps 9."""
    _, hit = hybrid_hit_setup([0, 1, 2, 3, 4, 5, 6, 9])
    assert hit.num_tokens == 144
    assert hit.block_ids == [list(range(1, 10)), [0] * 7 + [19, 20]]


def test_hybrid_search_iterates_to_a_fixed_point_across_three_kinds():
    coordinator = make_coordinator([FULL, SWA, MAMBA_ALIGN], num_blocks=60)
    seed = request("seed", range(170))
    run_prefill(coordinator, seed, 96, 144)  # Mamba states cached at 96 and 144 only
    coordinator.free(seed)
    pool = coordinator.block_pool
    mamba_positions = [i for i, h in enumerate(seed.block_hashes) if pool.get_cached_block(h, 2)]
    assert mamba_positions == [5, 8]
    pool.evict_blocks([pool.get_cached_block(seed.block_hashes[7], 1).block_id])
    probe = request("probe", range(170))
    hit = coordinator.find_longest_cache_hit(probe)
    # Pass 1: full 160, SWA 160, Mamba 144. Pass 2: SWA (<= 144, block 7 gone) 112, Mamba 96.
    # Pass 3: SWA 96, Mamba 96: fixed point.
    assert hit.num_tokens == 96
    full_ids, swa_ids, mamba_ids = hit.block_ids
    assert len(full_ids) == 6 and swa_ids[:4] == [0] * 4 and len(swa_ids) == 6
    assert mamba_ids[:5] == [0] * 5 and len(mamba_ids) == 6
    hashes = probe.block_hashes
    for group_id, blocks in enumerate(hit.blocks):
        for position, block in enumerate(blocks):
            if not block.is_null:
                assert block.block_hash == make_group_key(hashes[position], group_id)


def test_hybrid_leaves_ring_buffers_out_of_the_search_and_gives_them_one_block():
    coordinator = make_coordinator([FULL, MAMBA_ALIGN, RING], num_blocks=30)
    seed = request("seed", range(100))
    run_prefill(coordinator, seed, 64)
    coordinator.free(seed)
    probe = request("probe", range(100))
    hit, tables = run_prefill(coordinator, probe)
    assert hit.num_tokens == 64
    full_ids, mamba_ids, ring_ids = hit.block_ids
    assert (len(full_ids), mamba_ids[:3], len(mamba_ids), ring_ids) == (4, [0, 0, 0], 4, [])
    assert len(tables[2]) == 1 and tables[1][:4] == mamba_ids and tables[1][4:6] == [0, 0]
    assert len(coordinator.get_block_ids(probe)[1]) == 7


def test_hybrid_with_one_cacheable_group_searches_it_alone():
    coordinator = make_coordinator([FULL, RING], num_blocks=20)
    assert coordinator.is_simple and len(coordinator.spec_groups) == 1
    seed = request("seed", range(50))
    _, tables = run_prefill(coordinator, seed)
    assert tables == [[1, 2, 3, 4], [5]]
    coordinator.free(seed)
    hit, tables = run_prefill(coordinator, request("probe", range(50)))
    assert (hit.num_tokens, hit.block_ids) == (48, [[1, 2, 3], []])
    assert tables == [[1, 2, 3, 5], [4]]  # the freed ring block (never cached) is reused first


def test_hybrid_with_mamba_none_never_hits():
    # The planner hashes at the scheduler block here (no "align" Mamba): 16-token full
    # attention blocks could not even be keyed, and no hit could hold in the Mamba group.
    coordinator = make_coordinator(
        [FULL, MAMBA_NONE], num_blocks=30, scheduler_block_size=16, hash_block_size=16
    )
    assert type(coordinator) is NoPrefixCacheCoordinator
    seed = request("seed", range(100))
    _, tables = run_prefill(coordinator, seed)
    assert [len(ids) for ids in tables] == [7, 1]
    assert coordinator.find_longest_cache_hit(request("probe", range(100))).num_tokens == 0


def test_hybrid_hit_alignment_falls_back_to_the_scheduler_block_without_copy_on_write():
    mamba_32 = MambaSpec(
        block_size=32, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align"
    )
    coordinator = make_coordinator(
        [FULL, mamba_32], num_blocks=30, scheduler_block_size=32, cache_hit_alignment=16
    )
    assert coordinator.cache_hit_alignment == 32
    assert all(manager.cache_hit_alignment == 32 for manager in coordinator.managers)


def test_only_attention_blocks_are_reported_for_zeroing():
    coordinator = make_coordinator([FULL, MAMBA_ALIGN, RING], num_blocks=30)
    _, (full_ids, _, _) = run_prefill(coordinator, request("a", range(40)))
    assert coordinator.take_new_block_ids() == full_ids
    assert coordinator.take_new_block_ids() == []
    plain = make_coordinator([FULL, SWA], num_blocks=30)
    run_prefill(plain, request("a", range(40)))
    assert plain.take_new_block_ids() == []  # one dtype, no recurrent state


def test_sliding_window_positions_become_null_as_decode_moves_on():
    coordinator = make_coordinator([FULL, SWA], num_blocks=30)
    req = request("a", range(63))
    run_prefill(coordinator, req)
    req.append_token_ids([1])
    assert coordinator.allocate(req, 1) == [[], []]
    assert coordinator.get_block_ids(req)[1] == [0, 0, 7, 8]  # 63 - 31 = 32 skipped
    req.num_computed_tokens = 64
    req.append_token_ids([2])
    assert coordinator.allocate(req, 1) == [[9], [10]]
    assert coordinator.get_block_ids(req)[1] == [0, 0, 7, 8, 10]


def test_every_block_is_free_after_all_requests_end():
    coordinator = make_coordinator([FULL, SWA, MAMBA_ALIGN], num_blocks=60)
    requests = [request(f"r{i}", [*COMMON, i, i]) for i in range(3)]
    for req in requests:
        run_prefill(coordinator, req)
    assert coordinator.num_free_blocks < 59
    for req in requests:
        coordinator.free(req)
    assert coordinator.num_free_blocks == 59 and coordinator.usage == 0.0
    assert all(block.ref_cnt == 0 for block in coordinator.block_pool.blocks)


def test_hash_views_for_coarse_groups_use_the_last_fine_hash():
    full_32 = FullAttentionSpec(block_size=32, **ATTN)
    coordinator = make_coordinator(
        [FULL, full_32], num_blocks=30, scheduler_block_size=32, cache_hit_alignment=32
    )
    seed = request("seed", range(100))
    run_prefill(coordinator, seed)
    coarse = hashes_for_block_size(seed.block_hashes, 16, 32)
    block = coordinator.block_pool.get_cached_block(coarse[1], 1)
    assert block is not None and block.hash_num_tokens == 64
    hit = coordinator.find_longest_cache_hit(request("probe", range(100)))
    assert hit.num_tokens == 96 and [len(ids) for ids in hit.block_ids] == [6, 3]


# ----- benchmark smoke test -----------------------------------------------------------


def test_benchmark_quick_run_prints_every_row(capsys):
    assert bench_main(["--quick"]) == 0
    output = capsys.readouterr().out
    for row in (
        "a. decode step, 256 reqs, 3 groups: median",
        "a. decode step, 256 reqs, 3 groups: p99",
        "b. longest hit, 32k prompt, full only, fully cached",
        "b. longest hit, 32k prompt, 3 groups, half cached",
        "c. allocate+free per block, 1000 blocks",
        "c. allocate+free per block, 100000 blocks",
    ):
        assert row in output


# ----- hybrid prefix hits with checkpointed recurrent state -----------------------------

MAMBA_128 = MambaSpec(block_size=128, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align")
CHECKPOINTED_128 = msgspec.structs.replace(MAMBA_128, num_prefill_checkpoint_blocks=4)
SHARED = list(range(300))


def shared_prefix_hit(mamba: MambaSpec, *chunk_ends: int):
    """The hit of a request sharing 300 tokens with one computed before it (in chunks ending
    at ``chunk_ends``, then at its 400-token prompt end)."""
    coordinator = make_coordinator(
        [FULL, mamba], num_blocks=80, scheduler_block_size=128, cache_hit_alignment=16
    )
    first = request("first", SHARED + [1000 + i for i in range(100)])
    run_prefill(coordinator, first, *chunk_ends)
    return coordinator.find_longest_cache_hit(
        request("second", SHARED + [2000 + i for i in range(100)])
    )


def test_checkpointed_states_give_a_300_token_shared_prefix_its_last_state_boundary():
    hit = shared_prefix_hit(CHECKPOINTED_128)
    assert hit.num_tokens == 256
    assert hit.group_num_tokens == (256, 256)  # hits end on the 128-token state grid


def test_a_state_only_where_steps_end_misses_a_shared_prefix_and_says_which_group():
    hit = shared_prefix_hit(MAMBA_128)  # the prompt in one step: no state on the grid
    assert hit.num_tokens == 0
    assert hit.group_num_tokens == (256, 0)


def test_a_checkpoint_in_unique_tokens_does_not_cancel_the_shared_hit():
    # The first request's step ends at 384, inside its own tokens: without checkpoints that
    # is its only cached state and the second request gets nothing (vLLM issue 45238).
    assert shared_prefix_hit(MAMBA_128, 384).num_tokens == 0
    hit = shared_prefix_hit(CHECKPOINTED_128, 384)
    assert (hit.num_tokens, hit.group_num_tokens) == (256, (256, 256))
