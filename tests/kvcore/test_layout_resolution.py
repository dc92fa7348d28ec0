"""Layout resolution across backends and ranks (reference §2.4)."""

from __future__ import annotations

import pytest

from kvcore import FullAttentionSpec, KVCacheLayout, KVCacheLayoutError, MambaSpec
from kvcore.layout_resolution import (
    DEFAULT_LAYOUT_PREFERENCE,
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)

L = KVCacheLayout
UNIFORM = [FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float16")] * 3
MIXED = [
    FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float16"),
    MambaSpec(block_size=16, shapes=((32,),), dtypes=("bfloat16",)),
]


def test_backend_declarations_intersect_by_first_choice_votes():
    combined = get_supported_kv_cache_layouts([("LBNHC", "LBHNC"), ("LBHNC", "LBNHC", "BLHNC")])
    assert combined == [L.LBHNC, L.LBNHC]  # one vote each; the tie goes by enum order
    assert resolve_kv_cache_layout(None, [combined], UNIFORM) is L.LBHNC
    assert resolve_kv_cache_layout(None, [combined], MIXED) is L.LBHNC  # both block compact


def test_identical_declarations_keep_their_order_and_none_means_default():
    assert get_supported_kv_cache_layouts([("BLHNC", "LBNHC"), ("BLHNC", "LBNHC")]) == [
        L.BLHNC,
        L.LBNHC,
    ]
    assert get_supported_kv_cache_layouts([None, None]) == list(DEFAULT_LAYOUT_PREFERENCE)
    assert get_supported_kv_cache_layouts([None, ("HND",)]) == [L.LBHNC]


def test_disjoint_backends_are_refused():
    with pytest.raises(KVCacheLayoutError, match="No KV cache layout satisfies every"):
        get_supported_kv_cache_layouts([("LHBNC",), ("LBHNC",)])


def test_mixed_shapes_keep_only_block_compact_layouts():
    assert resolve_kv_cache_layout(None, [["LHBNC", "BLNHC"]], MIXED) is L.BLNHC
    assert resolve_kv_cache_layout(None, [["LHBNC", "BLNHC"]], UNIFORM) is L.LHBNC
    with pytest.raises(KVCacheLayoutError, match="mixed HNC shapes need a block-compact") as info:
        resolve_kv_cache_layout(None, [["LHBNC"]] * 2, MIXED)
    assert "BLHNC" in str(info.value)


def test_requested_layout_wins_when_every_rank_supports_it():
    ranks = [["LBNHC", "LBHNC", "BLHNC"]] * 4
    assert resolve_kv_cache_layout("BLHNC", ranks, UNIFORM) is L.BLHNC
    assert resolve_kv_cache_layout("hnd", ranks, UNIFORM) is L.LBHNC


def test_requested_layout_the_ranks_cannot_serve_is_refused_by_name():
    with pytest.raises(KVCacheLayoutError) as info:
        resolve_kv_cache_layout("BHLNC", [["LBNHC", "LBHNC"]], UNIFORM)
    message = str(info.value)
    assert "BHLNC" in message and "LBNHC" in message and "LBHNC" in message
    with pytest.raises(KVCacheLayoutError, match="does not satisfy"):
        resolve_kv_cache_layout("LHBNC", [["LHBNC", "BLHNC"]], MIXED)  # not block compact
    with pytest.raises(KVCacheLayoutError, match="Unknown KV cache layout 'XYZ'"):
        resolve_kv_cache_layout("XYZ", [["LBNHC"]], UNIFORM)


def test_ranks_must_report_and_agree():
    with pytest.raises(KVCacheLayoutError, match="No worker reported"):
        resolve_kv_cache_layout(None, [], UNIFORM)
    with pytest.raises(KVCacheLayoutError, match="No worker reported"):
        resolve_kv_cache_layout(None, [["LBNHC"], []], UNIFORM)
    with pytest.raises(KVCacheLayoutError, match="Workers disagree"):
        resolve_kv_cache_layout(None, [["LBNHC", "LBHNC"], ["LBHNC", "LBNHC"]], UNIFORM)
