"""Grouping: the decision tree, page unification, uniform-page groups and the packed planner."""

from __future__ import annotations

import pytest

from kvcore import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpecError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvcore.grouping import get_kv_cache_groups, unify_kv_cache_spec_page_size
from kvcore.packing import approximate_gcd

FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
SWA = SlidingWindowSpec(
    block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096
)


def layout_of(groups):
    return [(g.layer_names, type(g.kv_cache_spec).__name__) for g in groups]


def test_one_group_when_every_spec_merges():
    specs = {f"l{i}": FULL for i in range(4)}
    specs["l4"] = FullAttentionSpec(**{**_fields(FULL), "sliding_window": 128})
    (group,) = get_kv_cache_groups(specs, "LBNHC")
    assert group.layer_names == ["l0", "l1", "l2", "l3", "l4"]
    assert group.kv_cache_spec.sliding_window == 128


def _fields(spec):
    return {name: getattr(spec, name) for name in type(spec).__struct_fields__}


def test_one_uniform_type_group_for_one_family_with_mixed_pages():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")
    (group,) = get_kv_cache_groups({"a": FULL, "m": mla}, "LBNHC")
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.kv_cache_spec.page_size_bytes == FULL.page_size_bytes + mla.page_size_bytes


def test_hybrid_full_and_swa_same_page_example():
    """Reference §4.4: 2 full + 4 SWA layers, group size 2, strided assignment."""
    specs = {"f0": FULL, "s0": SWA, "s1": SWA, "f1": FULL, "s2": SWA, "s3": SWA}
    groups = get_kv_cache_groups(specs, "LBNHC")
    assert layout_of(groups) == [
        (["f0", "f1"], "FullAttentionSpec"),
        (["s0", "s2"], "SlidingWindowSpec"),
        (["s1", "s3"], "SlidingWindowSpec"),
    ]


def test_close_bucket_sizes_use_the_larger_group_size():
    """12 SWA + 13 full layers: one group each (13 < 1.5 * 12), the SWA group padded."""
    specs = {f"s{i}": SWA for i in range(12)} | {f"f{i}": FULL for i in range(13)}
    groups = get_kv_cache_groups(specs, "LBHNC")
    assert [len(g.layer_names) for g in groups] == [12, 13]


def test_page_unification_scales_block_size_or_pads():
    small = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype="bfloat16")
    odd = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=3, head_size=128, dtype="bfloat16", attention_chunk_size=64
    )
    state = MambaSpec(block_size=16, shapes=((100,),), dtypes=("float32",))
    unified = unify_kv_cache_spec_page_size({"big": FULL, "small": small, "odd": odd, "m": state})
    assert unified["big"] is FULL
    assert unified["small"].block_size == 64  # 4x the block, same page
    assert unified["odd"].page_size_padded == FULL.page_size_bytes  # 3 heads don't divide: pad
    assert unified["m"].page_size_padded == FULL.page_size_bytes
    assert {s.page_size_bytes for s in unified.values()} == {FULL.page_size_bytes}


def test_page_unification_refuses_mla_that_cannot_be_padded():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=96, dtype="bfloat16")
    with pytest.raises(KVCacheSpecError, match="Layer mla: page size 3072 is not divisible"):
        unify_kv_cache_spec_page_size({"big": FULL, "mla": mla})


def csa_linear_specs(mamba_cache_mode: str = "none") -> dict:
    """Reference §4.6: 7 GDN states, 1 replicated PLE state, 3 x (main, compressed, ring)."""
    specs = {
        f"gdn.{i}": MambaSpec(
            block_size=16, shapes=((32,),), dtypes=("bfloat16",), mamba_cache_mode=mamba_cache_mode
        )
        for i in range(7)
    }
    specs["ple"] = MambaSpec(
        block_size=16,
        shapes=((24,),),
        dtypes=("bfloat16",),
        tp_replicated=True,
        mamba_cache_mode=mamba_cache_mode,
    )
    for i in range(3):
        specs[f"main.{i}"] = FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=16, dtype="bfloat16"
        )
        specs[f"comp.{i}"] = MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=16, dtype="bfloat16", tokens_per_state=4
        )
        specs[f"ring.{i}"] = CircularBufferSpec(
            block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype="bfloat16"
        )
    return specs


def test_csa_linear_packed_groups():
    specs = csa_linear_specs()
    pages = {name: spec.page_size_bytes for name, spec in specs.items()}
    assert (pages["gdn.0"], pages["ple"], pages["main.0"], pages["comp.0"], pages["ring.0"]) == (
        64,
        48,
        2048,
        128,
        64,
    )
    groups = get_kv_cache_groups(specs, "BLNHC")
    assert [g.layer_names for g in groups] == [
        ["gdn.0", "gdn.3", "gdn.6"],
        ["gdn.1", "gdn.4"],
        ["gdn.2", "gdn.5"],
        ["ple"],
        ["main.0", "comp.0", "main.1", "comp.1", "main.2", "comp.2"],
        ["ring.0", "ring.1", "ring.2"],
    ]
    replicated = [
        g
        for g in groups
        if any(getattr(g.layer_spec(n), "tp_replicated", False) for n in g.layer_names)
    ]
    assert [g.layer_names for g in replicated] == [["ple"]]
    cacheable = [g.kv_cache_spec.prefix_cacheable for g in groups]
    assert cacheable == [True, True, True, True, True, False]
    assert isinstance(groups[4].kv_cache_spec, UniformTypeKVCacheSpecs)


def test_layer_outermost_layouts_unify_pages_instead_of_packing():
    groups = get_kv_cache_groups(csa_linear_specs(), "LBNHC")
    pages = {g.layer_spec(n).page_size_bytes for g in groups for n in g.layer_names}
    assert pages == {2048}
    block_sizes = {n: g.layer_spec(n).block_size for g in groups for n in g.layer_names}
    # The compressed MLA page (128) and the ring (64) scale their blocks; states are padded.
    assert (block_sizes["comp.0"], block_sizes["ring.0"], block_sizes["gdn.0"]) == (256, 128, 16)
    # The lone PLE bucket sets the group size to 1: one group per layer.
    assert [len(g.layer_names) for g in groups] == [1] * 17


@pytest.mark.parametrize(
    ("values", "lower_bound", "expected"),
    [([7, 1, 3, 3], 3, 3), ([4, 8, 12], 1, 4), ([6, 6], 1, 6), ([5, 7], 9, 9), ([7], 1, 7)],
)
def test_approximate_gcd(values, lower_bound, expected):
    assert approximate_gcd(values, lower_bound) == expected


@pytest.mark.parametrize("values", [[], [3, 0], [-1]])
def test_approximate_gcd_refuses_bad_input(values):
    with pytest.raises(ValueError):
        approximate_gcd(values)
