"""Scheduler / hash block sizes and per-state prefix alignment: the three §4.8 results."""

from __future__ import annotations

import pytest

from kvcore import (
    FullAttentionSpec,
    KVCacheSpecError,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)
from kvcore.block_sizes import BlockSizes, resolve_kv_cache_block_sizes
from kvcore.grouping import get_kv_cache_groups
from kvcore.kv_cache_config import KVCacheGroupSpec

from .test_grouping import csa_linear_specs


def test_csa_linear_resolves_to_16_16():
    groups = get_kv_cache_groups(csa_linear_specs("align"), "BLNHC")
    assert resolve_kv_cache_block_sizes(groups, prefix_match_unit=16) == BlockSizes(16, 16, 16)
    # The ring (block 4) is never prefix-cached, so it does not drag the gcd down to 4.
    assert resolve_kv_cache_block_sizes(groups) == BlockSizes(16, 16, 16)


def test_csa_linear_with_a_finer_unit_breaks_per_state_alignment():
    groups = get_kv_cache_groups(csa_linear_specs("align"), "BLNHC")
    with pytest.raises(KVCacheSpecError, match="per-state compression") as info:
        resolve_kv_cache_block_sizes(groups, prefix_match_unit=2)
    assert "alignments=[4]" in str(info.value)


def test_fine_hashes_with_coarse_hits():
    compressed_4 = MLAAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=64, dtype="bfloat16", tokens_per_state=4
    )
    compressed_128 = MLAAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=64, dtype="bfloat16", tokens_per_state=128
    )
    state = SlidingWindowMLASpec(
        block_size=4, num_kv_heads=1, head_size=64, dtype="bfloat16", sliding_window=8
    )
    wrapper = UniformTypeKVCacheSpecs.from_specs(
        {"compressed.4": compressed_4, "compressed.128": compressed_128}
    )
    groups = [
        KVCacheGroupSpec(layer_names=["compressed.4", "compressed.128"], kv_cache_spec=wrapper),
        KVCacheGroupSpec(layer_names=["compressor_state"], kv_cache_spec=state),
    ]
    assert resolve_kv_cache_block_sizes(groups) == BlockSizes(256, 4, 256)


def test_one_group_and_caching_off_use_the_scheduler_block():
    full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype="float16")
    state = SlidingWindowMLASpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8
    )
    one = [KVCacheGroupSpec(layer_names=["a"], kv_cache_spec=full)]
    two = [*one, KVCacheGroupSpec(layer_names=["b"], kv_cache_spec=state)]
    assert resolve_kv_cache_block_sizes(one) == BlockSizes(32, 32, 32)
    assert resolve_kv_cache_block_sizes(two, enable_prefix_caching=False) == BlockSizes(32, 32, 32)
    assert resolve_kv_cache_block_sizes(two) == BlockSizes(32, 4, 32)


def test_non_align_mamba_hashes_at_the_scheduler_block():
    groups = get_kv_cache_groups(csa_linear_specs("none"), "BLNHC")
    assert resolve_kv_cache_block_sizes(groups) == BlockSizes(16, 16, 16)


def test_unit_that_does_not_divide_the_groups_is_refused():
    groups = get_kv_cache_groups(csa_linear_specs("align"), "BLNHC")
    with pytest.raises(KVCacheSpecError, match="must be divisible by prefix_match_unit"):
        resolve_kv_cache_block_sizes(groups, prefix_match_unit=5)
