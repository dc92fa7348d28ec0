"""Recurrent state (Mamba, linear attention): one state block stands for the whole prefix.

Two modes (``MambaSpec.mamba_cache_mode``):

* ``"none"``: each request holds ``1 + num_speculative_blocks`` state blocks for its whole life,
  whatever its length. Nothing is cached, so a model with such a group never gets a prefix hit.
* ``"align"``: the table is indexed by position like an attention table, but only the block
  holding the current state is live: position i holds the state after ``(i + 1) * block_size``
  tokens once that many are computed. When a step's tokens reach a new position, a new block is
  claimed there and the positions in between stay null. Before the step the worker copies the
  state from the nearest non-null entry left of the new block (the previous state, or the
  cache hit's block) into it. That source block is freed one step later, once the copy has
  run, so a request holds at most two state blocks.

  A position is cached only when a step ends exactly on its boundary (``num_computed_tokens``
  a multiple of ``block_size``): only then does the block hold that prefix's state. So the
  scheduler should end prefill chunks on block boundaries to make a prompt's state reusable
  (e.g. schedule 100 prompt tokens as 96 + 4). A hit is the last cached aligned position,
  returned as ``[null] * i + [block]``.

  With ``num_prefill_checkpoint_blocks = k > 0`` a step that crosses position boundaries
  also checkpoints them: the (up to k) latest boundaries it crosses before its last position get
  blocks of their own, and the worker writes the state at each boundary into the block of that
  position (for the copy source, the block it copied from). Every non-null position whose
  boundary is computed is then cached, so a long prefill leaves a state every ``block_size``
  tokens, not only where it ended; such checkpoint blocks are freed (still cached) once
  cached. A shared prefix then hits at its last state boundary even when the first request's
  steps ended inside its own unique tokens.

  With ``num_speculative_blocks = k > 0`` (speculative decoding) a request also holds k draft
  blocks for its life beside its table (``draft_block_ids``), claimed with its first
  allocation: the worker keeps there the state after each draft a step verifies. They are
  never cached and never in the table, so positions and hits are as without them.

``"all"`` (a state block per position, all kept) is not supported yet and is refused at
construction.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._math import cdiv
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.kv_request import KVRequest
from kvcore.managers.base import NEVER, GroupManager, HitResult


class MambaManager(GroupManager):
    zeroes_new_blocks = False

    def __init__(self, spec, block_pool, group_id, **kwargs) -> None:
        super().__init__(spec, block_pool, group_id, **kwargs)
        self.mamba_cache_mode: str = self.spec.mamba_cache_mode
        self.num_speculative_blocks: int = self.spec.num_speculative_blocks
        if self.mamba_cache_mode == "all":
            raise ValueError(
                "mamba_cache_mode 'all' is not supported by kvray's block manager; "
                "use 'align' (prefix caching) or 'none'."
            )
        self.is_align = self.mamba_cache_mode == "align"
        # align mode: each request's draft blocks, outside its positional table.
        self._draft_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_checkpoints = self.spec.num_prefill_checkpoint_blocks if self.is_align else 0
        self.frees_blocks_early = self.is_align
        # align mode: table positions of previous state blocks, freed once the copy has run.
        self._pending_frees: dict[str, list[int]] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int, group_ids: Sequence[int]
    ) -> HitResult:
        if not self.is_align:
            return self._no_hit(group_ids)
        block_size = self.block_size
        hashes = self._block_hashes(block_hashes)
        pool = self.block_pool
        for index in range(min(max_length // block_size, len(hashes)) - 1, -1, -1):
            if (index + 1) * block_size % self.cache_hit_alignment:
                continue
            blocks = pool.get_cached_blocks(hashes[index], group_ids)
            if blocks is not None:
                nulls = [self.null_block] * index
                return [[*nulls, block] for block in blocks], (index + 1) * block_size
        return self._no_hit(group_ids)

    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        table = self.req_to_blocks.get(request_id)
        num_held = len(hit_blocks) if table is None else len(table)
        if self.is_align:
            num_positions = cdiv(num_tokens, self.block_size) - num_held
            num_new = 1 + min(num_positions - 1, self.num_checkpoints) if num_positions > 0 else 0
            if request_id not in self._draft_blocks:
                num_new += self.num_speculative_blocks
        else:
            num_new = max(1 + self.num_speculative_blocks - num_held, 0)
        num_evictable = sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        table = self.req_to_blocks[request_id]
        if not self.is_align:
            num_new = 1 + self.num_speculative_blocks - len(table)
            if num_new <= 0:
                return []
            new_blocks = self.block_pool.get_new_blocks(num_new)
            table.extend(new_blocks)
            return new_blocks
        if self.num_speculative_blocks and request_id not in self._draft_blocks:
            self._draft_blocks[request_id] = self.block_pool.get_new_blocks(
                self.num_speculative_blocks
            )
        num_required = cdiv(num_tokens, self.block_size)
        if num_required <= len(table):
            return []
        if table and not table[-1].is_null:
            # The current state block is this step's copy source; free it after the step.
            self._pending_frees.setdefault(request_id, []).append(len(table) - 1)
        num_before = len(table)
        num_between = num_required - 1 - num_before
        num_checkpoints = min(num_between, self.num_checkpoints)
        table.extend([self.null_block] * (num_between - num_checkpoints))
        table.extend(self.block_pool.get_new_blocks(num_checkpoints + 1))
        if num_checkpoints:
            # Checkpoints only feed the prefix cache; free them once they are cached.
            self._pending_frees.setdefault(request_id, []).extend(
                range(num_required - 1 - num_checkpoints, num_required - 1)
            )
        return table[num_before:]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        pending = self._pending_frees.get(request_id)
        if not pending:
            return
        # Once a token past the old block's position is computed, the copy out of it has run.
        limit = cdiv(num_computed_tokens, self.block_size) - 1
        if self.num_checkpoints and self.enable_caching:
            # A checkpointed state leaves only once it is in the prefix cache.
            limit = min(limit, self.num_cached_blocks.get(request_id, 0))
        table = self.req_to_blocks[request_id]
        removed = [table[index] for index in pending if index < limit]
        if not removed:
            return
        self._pending_frees[request_id] = [index for index in pending if index >= limit]
        for index in pending:
            if index < limit:
                table[index] = self.null_block
        self.block_pool.free_blocks(removed)

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Cache the state block at position ``n // block_size - 1`` when ``n`` (the computed
        tokens) ends exactly on its boundary; nothing else ever holds a cacheable state. With
        checkpoints, every held position whose boundary is computed holds its state."""
        if not self.is_align or num_computed_tokens == 0:
            return
        if self.num_checkpoints:
            super().cache_blocks(request, num_computed_tokens)
            return
        if num_computed_tokens % self.block_size:
            return
        table = self.req_to_blocks.get(request.request_id)
        index = num_computed_tokens // self.block_size - 1
        if table is None or index >= len(table):
            return
        self.block_pool.cache_full_blocks(
            table,
            self._block_hashes(request.block_hashes),
            index,
            index + 1,
            self.block_size,
            self.group_id,
        )

    def capacity_tokens(self, request_id: str) -> int:
        table = self.req_to_blocks[request_id]
        if self.is_align:
            return len(table) * self.block_size
        return NEVER if len(table) >= 1 + self.num_speculative_blocks else 0

    def next_skip_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        pending = self._pending_frees.get(request_id)
        if not pending:
            return NEVER
        # remove_skipped_blocks frees position i once more than (i + 1) * block_size
        # tokens are computed.
        return (min(pending) + 1) * self.block_size + 1

    def next_cache_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        if not self.is_align:
            return NEVER
        if self.num_checkpoints:
            return super().next_cache_tokens(request_id, num_computed_tokens)
        return (num_computed_tokens // self.block_size + 1) * self.block_size

    def draft_block_ids(self, request_id: str) -> list[int]:
        """The request's draft blocks in align mode (empty otherwise: in mode "none" they
        follow its state in its table)."""
        return [block.block_id for block in self._draft_blocks.get(request_id, ())]

    def free(self, request_id: str) -> None:
        self._pending_frees.pop(request_id, None)
        drafts = self._draft_blocks.pop(request_id, None)
        if drafts:
            self.block_pool.free_blocks(drafts)
        super().free(request_id)
