"""Random request streams through the coordinator, with the bookkeeping checked after every step.

Three models: full attention only; full + sliding window; full + Mamba ("align") + circular
buffer. Requests arrive with shared prefixes (some salted), are scheduled in chunks from their
cache hit, decode, get preempted when blocks run out or at random, and finish or are aborted.

Invariants, after every step:

* ref counts: every non-null block's ``ref_cnt`` equals the number of (request, group) table
  entries pointing at it (so it is never negative), and a block is in the free queue iff its
  ``ref_cnt`` is 0;
* ownership: a block appears in the tables of one group only, at most once per table, and in
  several requests' tables only as a shared prefix-cache hit (it is cached);
* the null block (id 0) is never allocated, freed, queued or cached;
* the prefix map and the blocks' hash fields agree both ways, and a cached block held in a table
  carries that group's id;
* content: a shadow of what each block holds (token ids for attention, the prefix a Mamba state
  covers) shows that every hit block holds exactly the request's tokens for its position;
* at the end, once every request is freed, every block is free again.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import msgspec
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcore import CircularBufferSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvcore.coordinator import KVCacheCoordinator
from kvcore.hashing import hashes_for_block_size, make_group_key, split_group_key
from kvcore.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvcore.kv_request import KVRequest
from kvcore.managers import FullAttentionManager, MambaManager, SlidingWindowManager

ATTN = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
FULL = FullAttentionSpec(block_size=4, **ATTN)
SWA = SlidingWindowSpec(block_size=4, sliding_window=8, **ATTN)
MAMBA = MambaSpec(block_size=8, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align")
RING = CircularBufferSpec(
    block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype="bfloat16"
)
MAX_MODEL_LEN = 64
MAX_STEP_TOKENS = 16
PREFIXES = [[(7 * p + 3 * i) % 50 for i in range(32)] for p in range(3)]
SETTINGS = settings(
    max_examples=150,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def make_config(specs, *, num_blocks: int, scheduler: int, alignment: int) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(layer_names=[f"l{i}"], kv_cache_spec=s) for i, s in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        layout="LBNHC",
        scheduler_block_size=scheduler,
        hash_block_size=4,
        cache_hit_alignment=alignment,
        max_model_len=MAX_MODEL_LEN,
    )


def check_bookkeeping(coordinator: KVCacheCoordinator) -> None:
    pool = coordinator.block_pool
    num_entries: Counter[int] = Counter()
    groups_of: defaultdict[int, set[int]] = defaultdict(set)
    for group_id, manager in enumerate(coordinator.managers):
        for table in manager.req_to_blocks.values():
            held = [block.block_id for block in table if not block.is_null]
            assert len(held) == len(set(held)), "a block twice in one table"
            for block_id in held:
                num_entries[block_id] += 1
                groups_of[block_id].add(group_id)
    free_ids = [block.block_id for block in pool.free_queue.get_all_free_blocks()]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    null = pool.null_block
    assert null.block_id == 0 and null.ref_cnt == 0 and null.block_hash is None
    assert 0 not in free_ids
    for block in pool.blocks[1:]:
        assert not block.is_null
        assert block.ref_cnt == num_entries[block.block_id] >= 0
        assert (block.block_id in free_ids) == (block.ref_cnt == 0)
        assert len(groups_of[block.block_id]) <= 1, "a block owned by two groups"
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "shared but not a prefix-cache hit"
    mapped = {}
    for key, block in pool.cached_blocks.iter_blocks():
        assert block.block_hash == key and block.block_id not in mapped
        mapped[block.block_id] = key
    assert set(mapped) == {b.block_id for b in pool.blocks if b.block_hash is not None}
    for block_id, key in mapped.items():
        assert groups_of[block_id] <= {split_group_key(key)[1]}
    assert coordinator.usage == 1 - len(free_ids) / (pool.num_blocks - 1)


class CoordinatorMachine(RuleBasedStateMachine):
    """Drives one coordinator; subclasses pick the model."""

    specs: tuple = ()
    num_blocks = 0
    scheduler_block_size = 4
    cache_hit_alignment = 4

    def __init__(self) -> None:
        super().__init__()
        config = make_config(
            self.specs,
            num_blocks=self.num_blocks,
            scheduler=self.scheduler_block_size,
            alignment=self.cache_hit_alignment,
        )
        self.coordinator = KVCacheCoordinator.from_config(config, max_num_batched_tokens=16)
        self.waiting: dict[str, KVRequest] = {}
        self.running: dict[str, KVRequest] = {}
        self.num_requests = 0
        # Shadow contents: block id -> token ids per slot (attention) or the prefix (Mamba).
        self.contents: dict[int, list] = {}

    # ----- rules ----------------------------------------------------------------------

    @initialize(prompts=st.lists(st.integers(0, len(PREFIXES) - 1), min_size=2, max_size=4))
    def start_with_requests(self, prompts):
        for prefix in prompts:
            self.add_request(prefix, 24, [prefix], None)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 32),
        tail=st.lists(st.integers(0, 49), max_size=12),
        salt=st.sampled_from([None, None, "tenant"]),
    )
    def add_request(self, prefix, prefix_len, tail, salt):
        tokens = PREFIXES[prefix][:prefix_len] + tail or [prefix]
        request_id = f"r{self.num_requests}"
        self.num_requests += 1
        self.waiting[request_id] = KVRequest(
            request_id, tokens, hash_block_size=self.coordinator.hash_block_size, cache_salt=salt
        )

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        hit = self.coordinator.find_longest_cache_hit(request)
        self.check_hit(request, hit)
        event("prefix-cache hit" if hit.num_tokens else "no hit")
        num_new = self.draw_chunk(data, hit.num_tokens, request.num_tokens)
        num_free = self.coordinator.num_free_blocks
        tables = self.coordinator.allocate(request, num_new, hit)
        if tables is None:
            event("first allocation refused")
            assert self.coordinator.num_free_blocks == num_free
            assert self.coordinator.get_block_ids(request) == [[] for _ in hit.blocks]
            return
        assert tables == self.coordinator.get_block_ids(request)
        hit_ids = {block.block_id for blocks in hit.blocks for block in blocks}
        self.forget_new_blocks(id_ for ids in tables for id_ in ids if id_ and id_ not in hit_ids)
        request.num_computed_tokens = hit.num_tokens  # the scheduler's bookkeeping
        self.check_spans(request)
        self.compute(request, hit.num_tokens, hit.num_tokens + num_new)
        self.running[request.request_id] = self.waiting.pop(request.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running(self, data):
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens == MAX_MODEL_LEN:
                self.end(request)
                return
            request.append_token_ids([data.draw(st.integers(0, 49))])  # the sampled token
        num_new = self.draw_chunk(data, request.num_computed_tokens, request.num_tokens)
        before = self.coordinator.get_block_ids(request)
        tables = self.coordinator.allocate(request, num_new)
        if tables is None:
            event("preempted: out of blocks")
            self.preempt_request(request)  # recompute later, as the scheduler would
            return
        after = self.coordinator.get_block_ids(request)
        for old, new, appended in zip(before, after, tables, strict=True):
            # Entries are appended; earlier ones only ever turn null (out of the span).
            assert len(new) == len(old) + len(appended) and new[len(old) :] == appended
            assert all(now in (was, 0) for now, was in zip(new[: len(old)], old, strict=True))
        self.forget_new_blocks(id_ for ids in tables for id_ in ids if id_ != 0)
        self.check_spans(request)
        start = request.num_computed_tokens
        self.compute(request, start, start + num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.preempt_request(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        request_id = data.draw(st.sampled_from(sorted([*self.running, *self.waiting])))
        self.end(self.running.get(request_id) or self.waiting[request_id])

    @rule()
    def reset_prefix_cache(self):
        assert self.coordinator.reset_prefix_cache() == (not self.running)

    @invariant()
    def bookkeeping_is_consistent(self):
        check_bookkeeping(self.coordinator)

    def teardown(self):
        for request in [*self.running.values(), *self.waiting.values()]:
            self.end(request)
        check_bookkeeping(self.coordinator)
        pool = self.coordinator.block_pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        assert all(block.ref_cnt == 0 for block in pool.blocks)

    # ----- the engine's side ------------------------------------------------------------

    def draw_chunk(self, data, num_computed: int, num_tokens: int) -> int:
        """Tokens to compute this step. Often the chunk ends on a scheduler block boundary, as
        an "align"-mode scheduler splits prefills, so Mamba states get cached."""
        longest = min(num_tokens - num_computed, MAX_STEP_TOKENS)
        boundary = (num_computed + longest) // self.scheduler_block_size * self.scheduler_block_size
        if boundary > num_computed and data.draw(st.booleans()):
            return boundary - num_computed
        return data.draw(st.integers(1, longest))

    def compute(self, request: KVRequest, start: int, end: int) -> None:
        """Write the KV of tokens [start, end), then register the full blocks."""
        for manager in self.coordinator.managers:
            table = manager.req_to_blocks[request.request_id]
            size = manager.block_size
            if isinstance(manager, MambaManager):
                # Checkpointed boundaries the step crosses hold the state at the boundary.
                for position in range(start // size, -(-end // size) - 1):
                    boundary = (position + 1) * size
                    if manager.num_checkpoints and start < boundary and not table[position].is_null:
                        self.check_writable(table[position])
                        self.contents[table[position].block_id] = request.token_ids[:boundary]
                state_block = table[-(-end // size) - 1]
                self.check_writable(state_block)
                self.contents[state_block.block_id] = request.token_ids[:end]
            elif isinstance(manager, FullAttentionManager | SlidingWindowManager):
                for position in range(start, end):
                    block = table[position // size]
                    self.check_writable(block)
                    self.contents[block.block_id][position % size] = request.token_ids[position]
        request.num_computed_tokens = end
        self.coordinator.cache_blocks(request, end)

    def check_spans(self, request: KVRequest) -> None:
        """After an allocation, before the step: the next token attends to every earlier
        token (full attention) or to the last W - 1 (sliding window); each must sit in a real
        block holding exactly that token. Blocks no later token needs are already gone: a
        window's older positions are null, a Mamba request holds at most two state blocks
        (the current one and the previous step's copy source), a ring request one block."""
        end = request.num_computed_tokens
        for manager in self.coordinator.managers:
            table = manager.req_to_blocks[request.request_id]
            held = [block for block in table if not block.is_null]
            if isinstance(manager, MambaManager):
                # The current state, the previous step's copy source, and checkpoints that
                # wait for the prefix cache (this step's and the last one's).
                assert 1 <= len(held) <= 2 + 2 * manager.num_checkpoints
                continue
            if not isinstance(manager, FullAttentionManager | SlidingWindowManager):
                assert len(table) == 1
                continue
            first = 0
            if isinstance(manager, SlidingWindowManager):
                first = max(0, end - manager.sliding_window + 1)
                assert all(block.is_null for block in table[: first // manager.block_size])
            for position in range(first, end):
                block = table[position // manager.block_size]
                assert not block.is_null, "a token in the span has no block"
                slot = position % manager.block_size
                assert self.contents[block.block_id][slot] == request.token_ids[position]

    @staticmethod
    def check_writable(block) -> None:
        """Writing into a shared or cached block would corrupt another request's KV."""
        assert not block.is_null, "KV written into the null block"
        assert block.ref_cnt == 1 and block.block_hash is None, "KV written into a shared block"

    def forget_new_blocks(self, block_ids) -> None:
        for block_id in block_ids:
            self.contents[block_id] = [None] * 8

    def check_hit(self, request: KVRequest, hit) -> None:
        assert hit.num_tokens <= request.num_tokens - 1
        assert hit.num_tokens % self.coordinator.cache_hit_alignment == 0
        for group_id, (manager, blocks) in enumerate(
            zip(self.coordinator.managers, hit.blocks, strict=True)
        ):
            if not manager.group_spec.prefix_cacheable:
                assert blocks == []
                continue
            size = manager.block_size
            assert len(blocks) == -(-hit.num_tokens // size)
            hashes = hashes_for_block_size(request.block_hashes, request.hash_block_size, size)
            for position, block in enumerate(blocks):
                if block.is_null:
                    continue
                assert block.block_hash == make_group_key(hashes[position], group_id)
                tokens = request.token_ids[position * size : (position + 1) * size]
                if isinstance(manager, MambaManager):
                    assert (
                        self.contents[block.block_id] == request.token_ids[: (position + 1) * size]
                    )
                else:
                    assert self.contents[block.block_id][:size] == tokens

    def preempt_request(self, request: KVRequest) -> None:
        self.coordinator.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = self.running.pop(request.request_id)

    def end(self, request: KVRequest) -> None:
        self.coordinator.free(request)
        self.running.pop(request.request_id, None)
        self.waiting.pop(request.request_id, None)


class FullOnlyMachine(CoordinatorMachine):
    specs = (FULL,)
    num_blocks = 24


class FullAndSlidingWindowMachine(CoordinatorMachine):
    specs = (FULL, SWA)
    num_blocks = 32


class FullMambaRingMachine(CoordinatorMachine):
    # The planner asks for hits at the 4-token hash unit here (the Mamba block is larger
    # than it); without copy-on-write the coordinator keeps hits on 8-token boundaries.
    specs = (FULL, MAMBA, RING)
    num_blocks = 32
    scheduler_block_size = 8
    cache_hit_alignment = 4


class FullCheckpointedMambaMachine(CoordinatorMachine):
    # Steps cross up to two 8-token boundaries; one checkpoint each: the cap is exercised.
    specs = (FULL, msgspec.structs.replace(MAMBA, num_prefill_checkpoint_blocks=1))
    num_blocks = 32
    scheduler_block_size = 8
    cache_hit_alignment = 4


TestFullOnly = FullOnlyMachine.TestCase
TestFullOnly.settings = SETTINGS
TestFullAndSlidingWindow = FullAndSlidingWindowMachine.TestCase
TestFullAndSlidingWindow.settings = SETTINGS
TestFullMambaRing = FullMambaRingMachine.TestCase
TestFullMambaRing.settings = SETTINGS
TestFullCheckpointedMamba = FullCheckpointedMambaMachine.TestCase
TestFullCheckpointedMamba.settings = SETTINGS
