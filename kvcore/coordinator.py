"""The KV-cache coordinator: the scheduler's only door to the block pool and the managers.

The scheduler sees block ids and counts, never free lists. Per request it calls:

* ``find_longest_cache_hit(request)`` before the first allocation (and again after a
  preemption), right before ``allocate``;
* ``allocate(request, num_new_tokens, cache_hit)`` every step it schedules the request;
  None means the pool cannot hold the step and nothing was allocated;
* ``cache_blocks(request, num_computed_tokens)`` after a step, so the computed full blocks
  become prefix-cache hits for later requests;
* ``free(request)`` when it finishes, is aborted or is preempted (then reset
  ``num_computed_tokens`` to 0; its blocks stay cached until evicted).

Three variants: caching off (``NoPrefixCacheCoordinator``: hit always 0, any number of groups),
one group (``UnitaryCoordinator``) and several (``HybridCoordinator``, fixed-point search).
Each registers itself by subclassing, in its own module (``kvcore`` imports them all), and
says which configurations it serves; ``KVCacheCoordinator.from_config`` picks the one that
does, so this module never imports its variants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvcore.attention_specs import AttentionSpec
from kvcore.block_pool import BlockPool
from kvcore.cache_hit import CacheHit, StaleCacheHitError
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.kv_cache_config import KVCacheConfig
from kvcore.kv_request import KVRequest
from kvcore.mamba_spec import MambaSpec
from kvcore.managers import NEVER, GroupManager, make_manager
from kvcore.uniform_spec import iter_layer_specs


def needs_kv_cache_zeroing(config: KVCacheConfig) -> bool:
    """Whether new attention blocks must be zeroed: with recurrent state or mixed-precision
    attention, stale bytes in a fresh page could be read as values."""
    attention_kinds = set()
    for group in config.kv_cache_groups:
        for spec in iter_layer_specs(group.kv_cache_spec):
            if isinstance(spec, MambaSpec):
                return True
            if isinstance(spec, AttentionSpec):
                attention_kinds.add((spec.dtype, spec.kv_quant_mode))
    return len(attention_kinds) > 1


class KVCacheCoordinator:
    """Shared bookkeeping of every variant: one block pool, one manager per group."""

    _variants: ClassVar[list[type[KVCacheCoordinator]]] = []  # every subclass, as defined

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        KVCacheCoordinator._variants.append(cls)

    @classmethod
    def serves(cls, config: KVCacheConfig, enable_caching: bool) -> bool:
        """Whether this variant is the one for ``config`` (exactly one variant says yes)."""
        raise NotImplementedError

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        max_num_batched_tokens: int,
        enable_caching: bool,
        cache_hit_alignment: int,
    ) -> None:
        self.config = config
        self.enable_caching = enable_caching
        self.max_model_len = config.max_model_len
        self.scheduler_block_size = config.scheduler_block_size
        self.hash_block_size = config.hash_block_size
        self.cache_hit_alignment = cache_hit_alignment
        _check_block_sizes(config, enable_caching)
        self.block_pool = BlockPool(config.num_blocks, enable_caching=enable_caching)
        needs_zeroing = needs_kv_cache_zeroing(config)
        self.managers: list[GroupManager] = [
            make_manager(
                group.kv_cache_spec,
                self.block_pool,
                group_id,
                hash_block_size=config.hash_block_size,
                cache_hit_alignment=cache_hit_alignment,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=config.max_model_len,
                enable_caching=enable_caching,
                needs_zeroing=needs_zeroing,
            )
            for group_id, group in enumerate(config.kv_cache_groups)
        ]
        # Only these managers ever free blocks before a request ends (see _allocate_running).
        self._early_freeing = [m for m in self.managers if m.frees_blocks_early]
        self._no_hit_blocks: tuple[tuple[KVCacheBlock, ...], ...] = ((),) * len(self.managers)
        self._no_new_blocks = _EMPTY_RESULTS.get(
            len(self.managers), lambda: [[] for _ in self.managers]
        )
        # Requests that hold blocks (allocated, not yet freed) -> fast-path bounds, see
        # _set_limits.
        self._limits: dict[str, list[int]] = {}

    @classmethod
    def from_config(
        cls, config: KVCacheConfig, *, max_num_batched_tokens: int, enable_caching: bool = True
    ) -> KVCacheCoordinator:
        """The variant that serves ``config``: caching off, no-cache; one group, unitary;
        otherwise hybrid (see each variant's ``serves``)."""
        (variant,) = [v for v in cls._variants if v.serves(config, enable_caching)]
        return variant(config, max_num_batched_tokens=max_num_batched_tokens)

    # ----- prefix-cache search ---------------------------------------------------------

    def find_longest_cache_hit(self, request: KVRequest) -> CacheHit:
        """The longest cached prefix of ``request``, at most ``num_tokens - 1`` tokens (the
        last token is always computed, for its logits). Call it right before ``allocate``:
        allocating for another request in between may evict the hit."""
        max_length = request.num_tokens - 1
        if max_length <= 0 or request.request_id in self._limits:
            return self.empty_hit()
        blocks, num_tokens = self._search(request.block_hashes, max_length)
        reach = self._group_reach()
        if num_tokens == 0:
            return CacheHit(0, [[] for _ in self.managers], group_num_tokens=reach)
        return CacheHit(num_tokens, blocks, self.block_pool.num_evictions, reach)

    def _group_reach(self) -> tuple[int, ...] | None:
        """Per group, the prefix it found alone in the last search (None: the hit itself)."""
        return None

    def _search(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[list[KVCacheBlock]], int]:
        raise NotImplementedError

    def empty_hit(self) -> CacheHit:
        return CacheHit(0, [[] for _ in self.managers])

    # ----- allocation ------------------------------------------------------------------

    def allocate(
        self, request: KVRequest, num_new_tokens: int, cache_hit: CacheHit | None = None
    ) -> list[list[int]] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and after
        ``cache_hit``, which only a request holding no blocks may pass).

        Returns, per group, the block ids appended to the request's block table by this call,
        in position order (for a request's first allocation: the whole table, hits included;
        id 0 is the null block, at positions that need no KV). Returns None, allocating
        nothing, when the pool lacks free blocks. Blocks of a running request that fell out
        of an attention window are returned to the pool first, whatever the outcome.
        """
        limits = self._limits.get(request.request_id)
        if limits is None or (cache_hit is not None and cache_hit.num_tokens):
            return self._allocate_first(request, num_new_tokens, cache_hit)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_computed = request.num_computed_tokens
        if num_computed + num_new_tokens <= limits[0] and num_computed < limits[1]:
            # Most decode steps: every table has room and no block is due to leave a window.
            return self._no_new_blocks()
        return self._allocate_running(request, num_new_tokens, limits)

    def _allocate_running(
        self, request: KVRequest, num_new_tokens: int, limits: list[int]
    ) -> list[list[int]] | None:
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        num_tokens = num_computed + num_new_tokens
        managers = self.managers
        if num_computed >= limits[1]:
            next_skip = NEVER
            for manager in self._early_freeing:
                manager.remove_skipped_blocks(request_id, num_computed)
                manager_next_skip = manager.next_skip_tokens(request_id, num_computed)
                if manager_next_skip < next_skip:
                    next_skip = manager_next_skip
            limits[1] = next_skip
        if num_tokens <= limits[0]:
            return self._no_new_blocks()
        self._check_length(request, num_tokens)
        num_needed = 0
        for manager in managers:
            num_needed += manager.num_blocks_to_allocate(request_id, num_tokens, (), num_computed)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        appended = [
            [block.block_id for block in manager.allocate_new_blocks(request_id, num_tokens)]
            for manager in managers
        ]
        self._set_limits(request_id, num_computed, limits)
        return appended

    def _allocate_first(
        self, request: KVRequest, num_new_tokens: int, cache_hit: CacheHit | None
    ) -> list[list[int]] | None:
        """The first allocation of a request holding no blocks, from its cache hit."""
        request_id = request.request_id
        hit_tokens = cache_hit.num_tokens if cache_hit is not None else 0
        self._check_first_allocation(request, cache_hit, num_new_tokens)
        hit_blocks = cache_hit.blocks if hit_tokens else self._no_hit_blocks
        num_computed = request.num_computed_tokens + hit_tokens
        num_tokens = num_computed + num_new_tokens
        num_needed = 0
        for manager, blocks in zip(self.managers, hit_blocks, strict=True):
            num_needed += manager.num_blocks_to_allocate(
                request_id, num_tokens, blocks, num_computed
            )
        if num_needed > self.block_pool.num_free_blocks:
            return None
        # Touch every group's hits before allocating in any group, so no allocation can
        # evict a block this request is about to share.
        for manager, blocks in zip(self.managers, hit_blocks, strict=True):
            manager.add_hit_blocks(request_id, blocks, num_computed)
        for manager in self.managers:
            manager.allocate_new_blocks(request_id, num_tokens)
        # cache_blocks has work at once: the hit set the cached-block counts.
        self._limits[request_id] = limits = [0, 0, 0]
        self._set_limits(request_id, num_computed, limits)
        return [[block.block_id for block in m.req_to_blocks[request_id]] for m in self.managers]

    def _set_limits(self, request_id: str, num_computed: int, limits: list[int]) -> None:
        """Recompute the fast-path bounds after an allocation: [tokens every table holds,
        computed tokens at which some block may leave a window, computed tokens at which
        cache_blocks has work (left alone)]."""
        capacity = self.max_model_len
        for manager in self.managers:
            manager_capacity = manager.capacity_tokens(request_id)
            if manager_capacity < capacity:
                capacity = manager_capacity
        next_skip = NEVER
        for manager in self._early_freeing:
            manager_next_skip = manager.next_skip_tokens(request_id, num_computed)
            if manager_next_skip < next_skip:
                next_skip = manager_next_skip
        limits[0] = capacity
        limits[1] = next_skip

    def _check_length(self, request: KVRequest, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} would hold {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )

    def _check_first_allocation(
        self, request: KVRequest, hit: CacheHit | None, num_new_tokens: int
    ) -> None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if request.request_id in self._limits:
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; a cache hit is only "
                "for its first allocation"
            )
        if request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id!r} holds no blocks but has num_computed_tokens="
                f"{request.num_computed_tokens}; reset it to 0 after a preemption"
            )
        hit_tokens = hit.num_tokens if hit is not None else 0
        self._check_length(request, hit_tokens + num_new_tokens)
        if hit_tokens and not hit.is_valid(self.block_pool):
            raise StaleCacheHitError(
                f"the cache hit of request {request.request_id!r} was evicted before "
                "allocation; call find_longest_cache_hit again right before allocate"
            )

    def num_blocks_needed(
        self,
        request: KVRequest,
        num_new_tokens: int,
        cache_hit: CacheHit | None = None,
        *,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks ``allocate`` would take (without freeing out-of-window blocks first).
        With ``apply_admission_cap``, windowed groups count at most what they can hold at
        once, as the pool sizer did: use it to reserve room for a request's whole sequence."""
        hit_tokens = cache_hit.num_tokens if cache_hit is not None else 0
        hit_blocks = cache_hit.blocks if hit_tokens else self._no_hit_blocks
        num_computed = request.num_computed_tokens + hit_tokens
        num_tokens = num_computed + num_new_tokens
        return sum(
            manager.num_blocks_to_allocate(
                request.request_id, num_tokens, blocks, num_computed, apply_admission_cap
            )
            for manager, blocks in zip(self.managers, hit_blocks, strict=True)
        )

    # ----- caching, freeing, queries ---------------------------------------------------

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Register the full blocks among the first ``num_computed_tokens`` tokens (whose KV
        is now written) in the prefix cache."""
        if not self.enable_caching:
            return
        limits = self._limits.get(request.request_id)
        if limits is None or num_computed_tokens < limits[2]:
            return  # holds no blocks, or no block has filled up since the last call
        next_cache = NEVER
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)
            manager_next = manager.next_cache_tokens(request.request_id, num_computed_tokens)
            if manager_next < next_cache:
                next_cache = manager_next
        limits[2] = next_cache

    def free(self, request: KVRequest) -> None:
        """Return every block of ``request`` to the pool (tail first). Idempotent."""
        request_id = request.request_id
        for manager in self.managers:
            manager.free(request_id)
        self._limits.pop(request_id, None)

    def get_block_ids(self, request: KVRequest) -> list[list[int]]:
        """The request's block table in each group (0 = the null block)."""
        return [
            [block.block_id for block in manager.get_blocks(request.request_id)]
            for manager in self.managers
        ]

    def get_draft_block_ids(self, request: KVRequest) -> list[list[int]]:
        """The request's draft-state blocks in each group (``draft_block_ids``), or [] when
        no group holds any."""
        ids = [manager.draft_block_ids(request.request_id) for manager in self.managers]
        return ids if any(ids) else []

    def take_new_block_ids(self) -> list[int]:
        """Blocks allocated since the last call that the workers must zero before use."""
        return [block_id for m in self.managers for block_id in m.take_new_block_ids()]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()


# Fresh "no new blocks" results for small group counts: a literal is much cheaper than a
# comprehension on the decode fast path.
_EMPTY_RESULTS = {
    0: lambda: [],
    1: lambda: [[]],
    2: lambda: [[], []],
    3: lambda: [[], [], []],
    4: lambda: [[], [], [], []],
}


def can_hit(config: KVCacheConfig, enable_caching: bool) -> bool:
    """Whether a prefix can ever hit. Not with caching off; nor for a hybrid model with a
    Mamba group outside "align" mode (that group keeps no per-prefix state)."""
    return enable_caching and not _has_stateless_mamba_hybrid(config)


def _has_stateless_mamba_hybrid(config: KVCacheConfig) -> bool:
    return len(config.kv_cache_groups) > 1 and any(
        isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align"
        for group in config.kv_cache_groups
        for spec in iter_layer_specs(group.kv_cache_spec)
    )


def _check_block_sizes(config: KVCacheConfig, enable_caching: bool) -> None:
    scheduler = config.scheduler_block_size
    if enable_caching and scheduler % config.hash_block_size:
        raise ValueError(
            f"scheduler_block_size {scheduler} is not a multiple of hash_block_size "
            f"{config.hash_block_size}"
        )
    for group_id, group in enumerate(config.kv_cache_groups):
        if scheduler % group.kv_cache_spec.block_size:
            raise ValueError(
                f"scheduler_block_size {scheduler} is not a multiple of group {group_id}'s "
                f"block size {group.kv_cache_spec.block_size}"
            )
