"""The coordinator of several KV-cache groups: a cache hit must hold in every group at once.

Groups that cannot be prefix-cached (circular buffers) are left out of the search; groups with
equal specs are searched together (one lookup covers all of them); full attention goes first.
The search then iterates to a fixed point: each group searches up to the length the groups
before it allowed, which can only shrink the hit; it stops when a whole pass leaves the hit
unchanged (with full attention plus one other kind, a single pass is already final, because
full attention's result can only be clamped, never shifted). Full-attention block lists are
finally truncated to the agreed length.

Hits end on a multiple of ``cache_hit_alignment``: the config's value when every cacheable
group's block divides it, else the scheduler block size. (A finer alignment would let a hit end
inside a block, which needs copy-on-write of the shared tail block; that is not implemented.)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._math import cdiv
from kvcore.coordinator import KVCacheCoordinator, can_hit
from kvcore.free_block_queue import KVCacheBlock
from kvcore.hashing import BlockHash
from kvcore.kv_cache_config import KVCacheConfig
from kvcore.managers import FullAttentionManager, GroupManager


def effective_cache_hit_alignment(config: KVCacheConfig) -> int:
    """The config's hit alignment if whole blocks of every cacheable group tile it, else the
    scheduler block size (which they always tile)."""
    alignment = config.cache_hit_alignment
    sizes = [
        group.kv_cache_spec.block_size
        for group in config.kv_cache_groups
        if group.kv_cache_spec.prefix_cacheable
    ]
    if alignment > 0 and all(alignment % size == 0 for size in sizes):
        return alignment
    return config.scheduler_block_size


class HybridCoordinator(KVCacheCoordinator):
    """Two or more groups with caching on."""

    @classmethod
    def serves(cls, config: KVCacheConfig, enable_caching: bool) -> bool:
        return can_hit(config, enable_caching) and len(config.kv_cache_groups) > 1

    def __init__(self, config: KVCacheConfig, *, max_num_batched_tokens: int) -> None:
        super().__init__(
            config,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=True,
            cache_hit_alignment=effective_cache_hit_alignment(config),
        )
        self.spec_groups = self._split_spec_groups()
        self._reach: list[int] = [0] * len(self.managers)
        # One spec group, or full attention plus one other: one pass reaches the fixed point.
        self.is_simple = len(self.spec_groups) == 1 or (
            len(self.spec_groups) == 2 and self._is_full(self.spec_groups[0][0])
        )

    @staticmethod
    def _is_full(manager: GroupManager) -> bool:
        return isinstance(manager, FullAttentionManager)

    def _split_spec_groups(self) -> list[tuple[GroupManager, list[int]]]:
        """(lead manager, group ids) per distinct cacheable spec, full attention first."""
        spec_groups: list[tuple[GroupManager, list[int]]] = []
        for group_id, manager in enumerate(self.managers):
            if not manager.group_spec.prefix_cacheable:
                continue
            if manager.block_size % self.hash_block_size:
                raise ValueError(
                    f"group {group_id}'s block size {manager.block_size} is not a multiple "
                    f"of the hash block size {self.hash_block_size}"
                )
            for lead, group_ids in spec_groups:
                if lead.group_spec == manager.group_spec:
                    group_ids.append(group_id)
                    break
            else:
                spec_groups.append((manager, [group_id]))
        if not spec_groups:
            raise ValueError("A hybrid coordinator needs at least one prefix-cacheable group")
        spec_groups.sort(key=lambda item: not self._is_full(item[0]))
        return spec_groups

    def _search(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[list[KVCacheBlock]], int]:
        results: list[tuple[list[list[KVCacheBlock]], int] | None] = [None] * len(self.spec_groups)
        self._reach = reach = [0] * len(self.managers)
        hit_length = max_length
        while True:
            current = hit_length
            for index, (manager, group_ids) in enumerate(self.spec_groups):
                found = results[index]
                if found is not None and self._is_full(manager):
                    current = min(current, found[1])  # a full-attention hit only shrinks
                    continue
                found = manager.find_longest_cache_hit(block_hashes, current, group_ids)
                results[index] = found
                current = found[1]
                for group_id in group_ids:
                    reach[group_id] = max(reach[group_id], current)
                if current == 0:
                    return self._per_group({}, 0), 0
            converged = current >= hit_length
            hit_length = current
            if converged or self.is_simple:
                break
        return self._per_group(results, hit_length), hit_length

    def _group_reach(self) -> tuple[int, ...]:
        return tuple(self._reach)

    def _per_group(self, results, hit_length: int) -> list[list[KVCacheBlock]]:
        """Every group's block list for a hit of ``hit_length`` tokens ([] for groups left
        out of the search)."""
        per_group: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        if hit_length == 0:
            return per_group
        for (manager, group_ids), (lists, length) in zip(self.spec_groups, results, strict=True):
            if length != hit_length:
                if not self._is_full(manager):
                    raise RuntimeError("hybrid cache-hit search ended off its fixed point")
                num_blocks = cdiv(hit_length, manager.block_size)
                lists = [blocks[:num_blocks] for blocks in lists]
            for group_id, blocks in zip(group_ids, lists, strict=True):
                per_group[group_id] = blocks
        return per_group
