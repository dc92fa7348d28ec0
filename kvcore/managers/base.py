"""The per-group block manager: one instance per KV-cache group, all sharing one block pool.

A manager keeps each request's block table for its group (``req_to_blocks``: position i holds
the block of tokens ``[i * block_size, (i + 1) * block_size)``, or the null block when that
position needs no KV any more) and how many leading positions are cached. Subclasses say how a
cache hit is searched, which tokens fall out of the attention span, and how blocks are claimed.

Allocation protocol, driven by the coordinator, for one request and one step:

1. ``remove_skipped_blocks(request_id, num_computed_tokens)`` (running requests): blocks that
   no later token attends to go back to the pool and become null in the table;
2. ``num_blocks_to_allocate(...)``: how many free blocks this step takes, hits included;
3. ``add_hit_blocks(...)`` (first allocation only): take references on the cache hit;
4. ``allocate_new_blocks(request_id, num_tokens)``: extend the table to hold ``num_tokens``.

``cache_blocks`` registers computed full blocks in the prefix map; ``free`` returns every block
(tail first, so the tail of a hash chain is evicted before its head).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvcore.block_pool import BlockPool
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash, hashes_for_block_size
from kvcore.kv_request import KVRequest
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import UniformTypeKVCacheSpecs

# A search result: one block list per searched group, and the hit length in tokens.
HitResult = tuple[list[list[KVCacheBlock]], int]

# A token count no request reaches: "this never happens" in the fast-path bounds below.
NEVER = sys.maxsize


class GroupManager:
    """Block tables of one KV-cache group. See the module docstring for the protocol."""

    # With recurrent state (whose pages alias attention pages) or mixed precisions, a reused
    # block may hold bytes that read as NaN, and attention kernels still load masked slots:
    # such configs report new attention blocks for zeroing. A recurrent state is copied or
    # initialised by its kernel and a ring is written before it is read, so those are not.
    zeroes_new_blocks = True
    # Whether blocks ever leave a request's table before it ends (windows, Mamba states).
    frees_blocks_early = False

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool: BlockPool,
        group_id: int,
        *,
        hash_block_size: int,
        cache_hit_alignment: int,
        enable_caching: bool = True,
        needs_zeroing: bool = False,
        max_admission_blocks: int | None = None,
    ) -> None:
        self.group_spec = spec
        # The spec whose kind decides behaviour (a uniform wrapper is managed as its members).
        self.spec = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.null_block = block_pool.null_block
        self.group_id = group_id
        self.hash_block_size = hash_block_size
        self.cache_hit_alignment = cache_hit_alignment
        self.enable_caching = enable_caching
        self.max_admission_blocks = max_admission_blocks
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading table positions already in the prefix map (running requests only).
        self.num_cached_blocks: dict[str, int] = {}
        self.new_block_ids: list[int] = []
        self._records_new_block_ids = needs_zeroing and self.zeroes_new_blocks

    # ----- prefix-cache search ---------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> HitResult:
        """The longest cached prefix of at most ``max_length`` tokens, as one block list per
        group in ``group_ids`` (groups with this manager's spec, searched together), ending
        on a multiple of ``cache_hit_alignment``. ``block_hashes`` are at hash-unit
        granularity. Positions whose KV is not needed hold the null block."""
        raise NotImplementedError

    def _block_hashes(self, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        return hashes_for_block_size(block_hashes, self.hash_block_size, self.block_size)

    def _no_hit(self, group_ids: Sequence[int]) -> HitResult:
        return [[] for _ in group_ids], 0

    # ----- allocation ------------------------------------------------------------------

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to, once ``num_computed_tokens`` are done."""
        return 0

    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks the request takes to hold ``num_tokens`` tokens: new blocks plus hit
        blocks that are now eviction candidates (touching them takes them off the queue).
        ``num_computed_tokens`` counts the hit. With ``apply_admission_cap`` the table size is
        clamped to what a windowed group can hold at once (the startup sizing bound)."""
        required = -(-num_tokens // self.block_size)
        if apply_admission_cap and self.max_admission_blocks is not None:
            required = min(required, self.max_admission_blocks)
        table = self.req_to_blocks.get(request_id)
        if table is not None:  # running: no new hits
            return required - len(table) if required > len(table) else 0
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new = max(required - max(num_skipped, len(hit_blocks)), 0)
        num_evictable = sum(
            1 for block in hit_blocks[num_skipped:] if block.ref_cnt == 0 and not block.is_null
        )
        return num_new + num_evictable

    def add_hit_blocks(
        self, request_id: str, hit_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """Start the table of a request that holds nothing yet from its cache hit (possibly
        empty). Hit blocks that are already out of the span become null."""
        if request_id in self.req_to_blocks:
            raise RuntimeError(f"request {request_id!r} already holds blocks in this group")
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = hit_blocks[num_skipped:]
        if self.enable_caching:
            self.block_pool.touch(kept)
        elif any(not block.is_null for block in hit_blocks):
            raise RuntimeError("A cache hit was given while prefix caching is off")
        table = [self.null_block] * num_skipped
        table.extend(kept)
        self.req_to_blocks[request_id] = table
        self.num_cached_blocks[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extend the table to hold ``num_tokens`` tokens. Returns the entries appended to the
        table, in position order: the new blocks (and null blocks at positions skipped over,
        for kinds whose tables have gaps)."""
        table = self.req_to_blocks[request_id]
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        self._record_new_blocks(new_blocks)
        return new_blocks

    def _record_new_blocks(self, new_blocks: list[KVCacheBlock]) -> None:
        if self._records_new_block_ids:
            self.new_block_ids.extend(block.block_id for block in new_blocks)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks before the attention span and put the null block in their place.
        Walks backwards and stops at the first null, which earlier calls already handled."""
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped <= 0:
            return
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        removed = []
        null_block = self.null_block
        for index in range(min(num_skipped, len(table)) - 1, -1, -1):
            block = table[index]
            if block.is_null:
                break
            removed.append(block)
            table[index] = null_block
        if removed:
            self.block_pool.free_blocks(removed)

    # ----- caching and freeing ---------------------------------------------------------

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Put the full blocks among the first ``num_computed_tokens`` tokens in the prefix
        map. Only for requests that hold blocks; blocks already cached are left alone."""
        request_id = request.request_id
        num_cached = self.num_cached_blocks.get(request_id)
        if num_cached is None:
            return
        num_full = num_computed_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request_id],
            self._block_hashes(request.block_hashes),
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
        )
        self.num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Return every block of the request, tail first. Unknown requests are ignored."""
        self.num_cached_blocks.pop(request_id, None)
        table = self.req_to_blocks.pop(request_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    # ----- fast-path bounds (the coordinator skips calls that would change nothing) ------

    def capacity_tokens(self, request_id: str) -> int:
        """Tokens the request's table holds without a new block."""
        return len(self.req_to_blocks[request_id]) * self.block_size

    def next_skip_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        """The least computed-token count at which ``remove_skipped_blocks`` may free a
        block, given that it has run at ``num_computed_tokens``."""
        return NEVER

    def next_cache_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        """The least computed-token count at which ``cache_blocks`` has work, given that it
        has run at ``num_computed_tokens``."""
        num_cached = self.num_cached_blocks.get(request_id)
        return NEVER if num_cached is None else (num_cached + 1) * self.block_size

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def draft_block_ids(self, request_id: str) -> list[int]:
        """Blocks the request holds beside its table for speculative decoding's draft states
        (a recurrent group's, ``kvcore.managers.mamba``); none for most kinds."""
        return []

    def take_new_block_ids(self) -> list[int]:
        """Block ids allocated since the last call that the worker must zero before use."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids
