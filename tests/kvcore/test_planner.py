"""The planner: tensors, offsets, block counts, memory refusals and capacity (§4.4-§4.9)."""

from __future__ import annotations

import pytest
import torch

from kvcore import (
    FullAttentionSpec,
    KVCacheLayoutError,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
    decode,
    encode,
)
from kvcore.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvcore.planner import (
    InsufficientKVCacheMemoryError,
    get_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
)

from .test_grouping import csa_linear_specs

GiB = 1 << 30
FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
SWA = SlidingWindowSpec(
    block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096
)
HYBRID = {"f0": FULL, "s0": SWA, "s1": SWA, "f1": FULL, "s2": SWA, "s3": SWA}


def plan(specs, memory, layout, **kw):
    options = dict(max_model_len=32_768, max_num_batched_tokens=8192) | kw
    return get_kv_cache_config(specs, memory, layout, **options)


def test_hybrid_full_and_swa_numbers():
    """Reference §4.4: three groups overlay 1 GiB; 3,586 blocks per request; 2.28 requests."""
    config = plan(HYBRID, GiB, "LBNHC")
    assert config.num_blocks == 8192
    assert config.bytes_per_block == 131_072
    assert [t.layers for t in config.kv_cache_tensors] == [["f0", "f1"], ["s0", "s2"], ["s1", "s3"]]
    for tensor in config.kv_cache_tensors:
        assert (tensor.size, tensor.layer_stride, tensor.block_stride, tensor.offset) == (
            GiB,
            65_536 * 8192,
            65_536,
            0,
        )
    assert config.max_concurrency == pytest.approx(8192 / 3586)
    assert round(config.max_concurrency, 2) == 2.28
    assert config.capacity_tokens == int(8192 / 3586 * 32_768)
    assert (config.scheduler_block_size, config.hash_block_size) == (16, 16)


def test_one_request_needs_3586_blocks():
    needed = 3586 * 131_072
    assert needed == 470_024_192
    plan(HYBRID, needed + 131_072, "LBNHC")  # exactly enough beside the null block
    with pytest.raises(InsufficientKVCacheMemoryError) as info:
        plan(HYBRID, needed, "LBNHC")
    message = str(info.value)
    assert "max seq len (32768)" in message
    assert "470024192 bytes" in message and "469893120 bytes" in message
    assert "estimated maximum model length is 32752" in message


def test_no_memory_at_all_is_refused():
    with pytest.raises(InsufficientKVCacheMemoryError, match="No available memory"):
        plan(HYBRID, 100_000, "LBNHC")


def test_csa_linear_packed_block_and_offsets():
    """Reference §4.6 / E8: 6,528-byte blocks; every offset inside the block."""
    config = plan(
        csa_linear_specs(), 6_528 * 100, "BLNHC", max_model_len=64, max_num_batched_tokens=64
    )
    assert config.bytes_per_block == 6_528
    assert config.num_blocks == 100
    tensors = {tuple(t.layers): t for t in config.kv_cache_tensors}
    assert {t.block_stride for t in tensors.values()} == {6_528}
    assert all(t.offset < 6_528 and t.size == 652_800 for t in tensors.values())
    mains = tensors[("main.0", "main.1", "main.2")]
    comps = tensors[("comp.0", "comp.1", "comp.2")]
    assert (mains.layer_stride, mains.offset) == (2_048, 0)
    assert (comps.layer_stride, comps.offset) == (128, 6_144)
    assert tensors[("gdn.0", "gdn.3", "gdn.6")].layer_stride == 64
    assert tensors[("ple",)].offset == 0


MLA_512 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512, dtype="uint8")
MLA_128 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=128, dtype="uint8")


def test_dense_packing_single_group_offsets():
    """Reference §4.7: mla.0, mla.1 (page 32,768) + idx.0 (page 8,192) in one group."""
    specs = {"mla.0": MLA_512, "mla.1": MLA_512, "idx.0": MLA_128}
    assert (MLA_512.page_size_bytes, MLA_128.page_size_bytes) == (32_768, 8_192)
    lbnhc = plan(specs, 73_728 * 10, "LBNHC", max_model_len=64)
    num_blocks = lbnhc.num_blocks
    assert num_blocks == 10
    by_layers = {tuple(t.layers): t for t in lbnhc.kv_cache_tensors}
    assert by_layers[("idx.0",)].offset == 2 * 32_768 * num_blocks
    assert by_layers[("mla.0", "mla.1")].block_stride == 32_768
    blhnc = plan(specs, 73_728 * 10, "BLHNC", max_model_len=64)
    by_layers = {tuple(t.layers): t for t in blhnc.kv_cache_tensors}
    assert by_layers[("idx.0",)].offset == 2 * 32_768
    assert {t.block_stride for t in blhnc.kv_cache_tensors} == {73_728}


def two_mla_groups():
    first = {f"mla.{i}": MLA_512 for i in range(3)} | {f"idx.{i}": MLA_128 for i in range(3)}
    return [
        KVCacheGroupSpec(
            layer_names=list(first), kv_cache_spec=UniformTypeKVCacheSpecs.from_specs(first)
        ),
        KVCacheGroupSpec(layer_names=[f"swa.{i}" for i in range(5)], kv_cache_spec=MLA_512),
    ]


def test_dense_packing_two_groups_alias_one_allocation():
    groups = two_mla_groups()
    config = get_kv_cache_config_from_groups(
        groups, 163_840 * 4, "BLNHC", max_model_len=64, max_num_batched_tokens=64
    )
    assert config.bytes_per_block == max(3 * 32_768 + 3 * 8_192, 5 * 32_768) == 163_840
    raw = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    views = {}
    for tensor in config.kv_cache_tensors:
        spec = config.kv_cache_groups[config.group_of(tensor.layers[0])].layer_spec(
            tensor.layers[0]
        )
        views |= create_kv_cache_views(raw, spec, config.num_blocks, config.layout, tensor)
    assert views["swa.0"].data_ptr() == views["mla.0"].data_ptr()
    for layout in ("LBNHC", "LHBNC"):
        with pytest.raises(KVCacheLayoutError, match=f"KV cache layout {layout} cannot express"):
            get_kv_cache_config_from_groups(
                groups, 163_840 * 4, layout, max_model_len=64, max_num_batched_tokens=64
            )


def test_num_blocks_override_and_attention_free_models():
    config = plan(HYBRID, GiB, "LBNHC", num_blocks_override=4000)
    assert config.num_blocks == 4000
    assert config.kv_cache_tensors[0].size == 4000 * 131_072
    empty = plan({}, GiB, "LBNHC")
    assert (empty.num_blocks, empty.kv_cache_tensors, empty.kv_cache_groups) == (1, [], [])


def test_every_rank_gets_the_smallest_ranks_plan():
    configs = get_kv_cache_configs(
        [HYBRID, dict(HYBRID)],
        [GiB, GiB // 2],
        "BLHNC",
        max_model_len=32_768,
        max_num_batched_tokens=8192,
    )
    assert configs[0] == configs[1]
    assert configs[0].num_blocks == 4096
    with pytest.raises(ValueError, match="rank 1"):
        get_kv_cache_configs(
            [HYBRID, {"f0": FULL}],
            [GiB, GiB],
            "BLHNC",
            max_model_len=32_768,
            max_num_batched_tokens=8192,
        )


def test_kv_cache_config_round_trips_through_msgspec():
    config = plan(
        csa_linear_specs(), 6_528 * 100, "BLNHC", max_model_len=64, max_num_batched_tokens=64
    )
    decoded = decode(encode(config), KVCacheConfig)
    assert decoded == config
    assert [type(g.kv_cache_spec) for g in decoded.kv_cache_groups] == [
        type(g.kv_cache_spec) for g in config.kv_cache_groups
    ]
    assert decoded.kv_cache_groups[4].layer_spec("comp.0").tokens_per_state == 4
