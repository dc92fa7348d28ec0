"""Scheduler and prefix-hash block sizes, with per-state prefix alignment (reference §4.8).

The scheduler allocates in blocks every group divides (their lcm). Prefix hashes are taken over
the finest prefix-cacheable block (their gcd; a circular buffer, never cached, does not drag it
down). A prefix hit must end on a boundary every compressed state respects: if some layer packs
k tokens into one state, a hit that ends mid-state cannot be resumed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import msgspec

from kvcore.errors import KVCacheSpecError
from kvcore.kv_cache_config import KVCacheGroupSpec
from kvcore.mamba_spec import MambaSpec
from kvcore.uniform_spec import iter_layer_specs


class BlockSizes(msgspec.Struct, frozen=True):
    scheduler_block_size: int
    hash_block_size: int
    cache_hit_alignment: int


def resolve_kv_cache_block_sizes(
    groups: Sequence[KVCacheGroupSpec],
    *,
    enable_prefix_caching: bool = True,
    prefix_match_unit: int | None = None,
) -> BlockSizes:
    if not groups:
        return BlockSizes(1, 1, 1)
    sizes = [group.kv_cache_spec.block_size for group in groups]
    scheduler = math.lcm(*sizes)
    if len(groups) == 1 or not enable_prefix_caching:
        return BlockSizes(scheduler, scheduler, scheduler)
    layer_specs = [(g, s) for g in groups for s in iter_layer_specs(g.kv_cache_spec)]
    mamba_specs = [s for _, s in layer_specs if isinstance(s, MambaSpec)]
    if any(spec.mamba_cache_mode != "align" for spec in mamba_specs):
        return BlockSizes(scheduler, scheduler, scheduler)
    cacheable = [g for g in groups if g.kv_cache_spec.prefix_cacheable]
    hashing_sizes = [g.kv_cache_spec.block_size for g in cacheable] or sizes
    hash_size = prefix_match_unit or math.gcd(*hashing_sizes)
    if any(size % hash_size for size in hashing_sizes):
        raise KVCacheSpecError(
            f"Invalid prefix_match_unit={hash_size}; prefix-cacheable KV cache group block "
            "sizes must be divisible by prefix_match_unit. Got group block sizes="
            f"{sizes}, prefix-cacheable={hashing_sizes}."
        )
    alignments = sorted(
        {
            int(spec.tokens_per_state)
            for group, spec in layer_specs
            if group.kv_cache_spec.prefix_cacheable and _is_compressed(spec.tokens_per_state)
        }
    )
    has_partial_mamba = any(
        s.mamba_cache_mode == "align" and s.block_size > hash_size for s in mamba_specs
    )
    alignment = hash_size if has_partial_mamba else scheduler
    if any(alignment % a for a in alignments):
        raise KVCacheSpecError(
            f"Invalid prefix_match_unit={hash_size}; prefix-cache boundaries must align with "
            f"each spec's per-state compression. Got alignments={alignments} for a cache-hit "
            f"alignment of {alignment} tokens."
        )
    return BlockSizes(scheduler, hash_size, alignment)


def _is_compressed(tokens_per_state: int | Fraction) -> bool:
    """One state holds several whole tokens."""
    return tokens_per_state > 1 and Fraction(tokens_per_state).denominator == 1
