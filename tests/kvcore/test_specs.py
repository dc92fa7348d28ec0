"""Spec fields, derived geometry, validation, merge and uniform-type rules (reference §1)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvcore import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecError,
    KVCacheSpecMergeError,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
    is_quantized_kv_cache,
    iter_layer_specs,
)


def full(**overrides) -> FullAttentionSpec:
    fields = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}
    return FullAttentionSpec(**{**fields, **overrides})


def test_base_spec_leaves_geometry_to_subclasses():
    spec = KVCacheSpec(block_size=16)
    assert spec.prefix_cacheable
    assert spec.max_num_blocks_per_req(33) == 3
    for name in ("num_heads", "tokens_per_state", "state_content_size_bytes", "page_size_bytes"):
        with pytest.raises(NotImplementedError):
            getattr(spec, name)
    with pytest.raises(NotImplementedError):
        spec.max_memory_usage_bytes(1024, 256)


def test_attention_defaults_and_derived_geometry():
    spec = full()
    assert spec.head_size_v == 128
    assert spec.kv_quant_mode is KVQuantMode.NONE
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (8, 16, 512)
    assert spec.unpadded_page_size_bytes == spec.real_page_size_bytes == 65_536
    assert spec.page_size_bytes == 65_536
    assert spec.max_memory_usage_bytes(1000, 256) == 63 * 65_536
    assert spec.max_num_blocks_per_req(1000) == 63


def test_backend_overrides_head_slots_content_and_padding():
    spec = full(num_head_slots=2, state_content_bytes=100, page_size_padded=4096)
    assert spec.num_heads == 2
    assert spec.state_content_size_bytes == 100
    assert spec.unpadded_page_size_bytes == 2 * 16 * 100
    assert spec.page_size_bytes == 4096


def test_tokens_per_state_int_and_fraction():
    compressed = full(tokens_per_state=4)
    assert compressed.num_states == 4
    assert compressed.get_num_kernel_states(8) == 2
    expanded = full(tokens_per_state=Fraction(1, 4))
    assert expanded.num_states == 64
    assert isinstance(expanded.num_states, int)
    assert expanded.page_size_bytes == 8 * 64 * 512


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"block_size": -16}, "block_size"),
        ({"dtype": "float64"}, "float64"),
        ({"tokens_per_state": 0}, "positive"),
        ({"tokens_per_state": 3}, "whole number of states"),
        ({"tokens_per_state": 1.5}, "int or a Fraction"),
        ({"page_size_padded": 100}, "smaller than the page"),
        ({"head_size_v": -1}, "head_size_v"),
    ],
)
def test_invalid_attention_fields_are_refused(overrides, match):
    with pytest.raises(KVCacheSpecError, match=match):
        full(**overrides)


def test_specs_are_frozen_hashable_and_compare_by_class_and_fields():
    assert full() == full() and hash(full()) == hash(full())
    assert len({full(), full(), full(block_size=32)}) == 2
    with pytest.raises(AttributeError):
        full().block_size = 32
    base = dict(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")
    assert FullAttentionSpec(**base) != MLAAttentionSpec(**base, head_size_v=64)


def test_mla_content_is_one_latent_vector_and_alignment_pads():
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert spec.head_size_v == 0
    assert spec.page_size_bytes == 16 * 576 * 2
    aligned = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype="uint8",
        state_content_bytes=656,
        alignment=4096,
    )
    assert aligned.page_size_padded == 45_056
    already = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=64, dtype="uint8", alignment=4096
    )
    assert already.page_size_padded is None  # 4096 is already aligned
    doubled = aligned.copy_with_new_block_size(128)
    assert doubled.page_size_padded == 86_016  # round_up(128 * 656, 4096), recomputed


def test_copy_with_new_block_size_keeps_other_fields():
    spec = full(sliding_window=128).copy_with_new_block_size(64)
    assert spec == full(block_size=64, sliding_window=128)


def test_sliding_window_admission_and_memory():
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096
    )
    assert spec.max_admission_blocks_per_request(8192, 131_072) == 769
    assert spec.max_memory_usage_bytes(131_072, 8192) == 769 * 65_536
    # A short model caps the admission at its own length, plus the unaligned-window block.
    assert spec.max_admission_blocks_per_request(8192, 1024) == 65


def test_chunked_local_admission():
    spec = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float16", attention_chunk_size=512
    )
    assert spec.max_admission_blocks_per_request(256, 131_072) == 48
    assert spec.max_memory_usage_bytes(131_072, 256) == 48 * spec.page_size_bytes


def test_circular_buffer_is_one_block_and_never_cacheable():
    ring = CircularBufferSpec(
        block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype="bfloat16"
    )
    assert not ring.prefix_cacheable
    assert ring.page_size_bytes == 64
    assert ring.max_num_blocks_per_req(100_000) == 1
    assert ring.max_memory_usage_bytes(100_000, 8192) == 64


def test_mamba_state_geometry_and_modes():
    spec = MambaSpec(block_size=1, shapes=((2,), (4,)), dtypes=("float32", "float16"))
    assert (spec.num_heads, spec.tokens_per_state, spec.num_states) == (1, -1, 1)
    assert spec.state_content_size_bytes == spec.page_size_bytes == 16
    assert not spec.tp_replicated
    assert spec.get_num_kernel_states(64) == 1
    assert spec.max_memory_usage_bytes(1024, 256) == 16
    assert spec.max_num_blocks_per_req(1024) == 1
    spec_all = MambaSpec(
        block_size=16,
        shapes=((4,),),
        dtypes=("float32",),
        mamba_cache_mode="all",
        num_speculative_blocks=2,
    )
    assert spec_all.max_memory_usage_bytes(100, 8) == (7 + 2) * 16
    assert spec_all.max_num_blocks_per_req(100) == 9
    spec_align = MambaSpec(
        block_size=16,
        shapes=((4,),),
        dtypes=("float32",),
        mamba_cache_mode="align",
        num_speculative_blocks=1,
        num_prefill_checkpoint_blocks=2,
    )
    assert spec_align.max_memory_usage_bytes(100, 8) == 16 * 5
    assert spec_align.max_num_blocks_per_req(100) == 8
    padded = MambaSpec(block_size=1, shapes=((2,),), dtypes=("float32",), page_size_padded=64)
    assert padded.page_size_bytes == 64


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"shapes": ((2,),), "dtypes": ()}, "one dtype per state"),
        ({"shapes": ((0,),), "dtypes": ("float32",)}, "positive"),
        ({"shapes": ((2,),), "dtypes": ("float32",), "page_size_padded": 4}, "smaller"),
        ({"shapes": ((2,),), "dtypes": ("float32",), "mamba_cache_mode": "some"}, "cache_mode"),
        ({"shapes": ((2,),), "dtypes": ("float32",), "num_heads": 2}, "num_heads"),
    ],
)
def test_invalid_mamba_fields_are_refused(fields, match):
    with pytest.raises(KVCacheSpecError, match=match):
        MambaSpec(block_size=1, **fields)


def test_full_attention_merge_takes_windows_and_ors_non_causal():
    merged = FullAttentionSpec.merge([full(), full(sliding_window=128), full(non_causal=True)])
    assert merged == full(sliding_window=128, non_causal=True)
    with pytest.raises(KVCacheSpecMergeError, match="same window size"):
        FullAttentionSpec.merge([full(sliding_window=128), full(sliding_window=256)])
    with pytest.raises(KVCacheSpecMergeError, match="both sliding window"):
        FullAttentionSpec.merge([full(sliding_window=128), full(attention_chunk_size=64)])
    with pytest.raises(KVCacheSpecMergeError, match="same attention spec"):
        FullAttentionSpec.merge([full(), full(num_kv_heads=4)])
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")
    with pytest.raises(KVCacheSpecMergeError, match=r"MLAAttentionSpec\.merge"):
        FullAttentionSpec.merge([full(), mla])


def test_mla_merge_requires_one_quantization_state_and_version():
    def mla(**kw):
        return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16", **kw)

    assert MLAAttentionSpec.merge([mla(), mla()]) == mla()
    with pytest.raises(KVCacheSpecMergeError, match="quantization method"):
        MLAAttentionSpec.merge([mla(cache_dtype_str="fp8"), mla()])
    with pytest.raises(KVCacheSpecMergeError, match="tokens per state"):
        MLAAttentionSpec.merge([mla(tokens_per_state=4), mla()])
    with pytest.raises(KVCacheSpecMergeError, match="non_causal_multi_token_decode"):
        MLAAttentionSpec.merge([mla(non_causal_multi_token_decode=True), mla()])


def test_default_merge_requires_identical_specs():
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=64
    )
    assert SlidingWindowSpec.merge([swa, swa]) is swa
    other = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=32
    )
    with pytest.raises(KVCacheSpecMergeError, match="must be the same"):
        SlidingWindowSpec.merge([swa, other])


def test_sliding_window_mla_merge_and_version():
    def swa_mla(**kw):
        return SlidingWindowMLASpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16", sliding_window=128, **kw
        )

    assert swa_mla().head_size_v == 0
    assert SlidingWindowMLASpec.merge([swa_mla(), swa_mla()]) == swa_mla()
    with pytest.raises(KVCacheSpecMergeError, match="window"):
        SlidingWindowMLASpec.merge([swa_mla(), swa_mla(extra_retained_tokens=4)])
    assert swa_mla(model_version="deepseek_v4").model_version == "deepseek_v4"
    with pytest.raises(KVCacheSpecError, match="deepseek_v4"):
        swa_mla(model_version="v3")


def test_uniform_type_rules():
    main = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="bfloat16")
    comp = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype="bfloat16", tokens_per_state=4
    )
    ring = CircularBufferSpec(
        block_size=16, num_kv_heads=1, head_size=8, head_size_v=0, dtype="bfloat16"
    )
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype="bfloat16", sliding_window=64
    )
    swa_mla = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype="bfloat16", sliding_window=64
    )
    gdn = MambaSpec(block_size=16, shapes=((32,),), dtypes=("bfloat16",))
    ple = MambaSpec(block_size=16, shapes=((32,),), dtypes=("bfloat16",), tp_replicated=True)
    is_uniform = UniformTypeKVCacheSpecs.is_uniform_type
    assert is_uniform([main, comp])  # MLA belongs to the full-attention family
    assert not is_uniform([main, ring])
    assert not is_uniform([main, main.copy_with_new_block_size(32)])
    assert not is_uniform([swa, swa_mla])  # same window, different class
    assert not is_uniform([swa, SlidingWindowSpec(**{**_fields(swa), "sliding_window": 32})])
    assert is_uniform([gdn, gdn])
    assert not is_uniform([gdn, ple])  # a replicated state never groups with sharded ones
    assert is_uniform([ring, ring])


def _fields(spec):
    return {name: getattr(spec, name) for name in type(spec).__struct_fields__}


def test_uniform_type_wrapper_sums_pages():
    main = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="bfloat16")
    comp = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype="bfloat16", tokens_per_state=4
    )
    layers = {"main0": main, "comp0": comp, "main1": main, "comp1": comp}
    wrapper = UniformTypeKVCacheSpecs.from_specs(layers)
    assert wrapper is not None
    assert wrapper.first_spec is main
    assert wrapper.page_size_bytes == 2 * 2048 + 2 * 128
    assert wrapper.get_max_layers_per_page_size() == 2
    assert wrapper.prefix_cacheable
    assert wrapper.max_num_blocks_per_req(100) == 7
    assert wrapper.max_memory_usage_pages(100, 8) == 7
    assert wrapper.max_memory_usage_bytes(100, 8) == 7 * wrapper.page_size_bytes
    assert iter_layer_specs(wrapper) == (main, comp, main, comp)
    assert iter_layer_specs(main) == (main,)
    ring = CircularBufferSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bfloat16")
    assert UniformTypeKVCacheSpecs.from_specs({"a": main, "r": ring}) is None


def test_uniform_wrapper_refuses_members_needing_different_table_widths():
    ring = CircularBufferSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="bfloat16")
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"r0": ring, "r1": ring})
    assert wrapper.max_num_blocks_per_req(100) == 1
    assert not wrapper.prefix_cacheable
    mixed = UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={
            "m0": MambaSpec(
                block_size=16, shapes=((4,),), dtypes=("float32",), mamba_cache_mode="align"
            ),
            "m1": MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)),
        },
    )
    with pytest.raises(KVCacheSpecError, match="same number of block table entries"):
        mixed.max_num_blocks_per_req(100)


def test_plain_attention_spec_is_concrete():
    spec = AttentionSpec(block_size=8, num_kv_heads=2, head_size=4, dtype="float32")
    assert spec.page_size_bytes == 2 * 8 * 32


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("int4_per_token_head", KVQuantMode.INT4_PER_TOKEN_HEAD),
        ("int8_per_token_head", KVQuantMode.INT8_PER_TOKEN_HEAD),
        ("fp8_per_token_head", KVQuantMode.FP8_PER_TOKEN_HEAD),
        ("nvfp4_ds_mla", KVQuantMode.NVFP4_DS_MLA),
        ("nvfp4", KVQuantMode.NVFP4),
        ("turboquant_k8v4", KVQuantMode.TURBOQUANT_K8V4),
        ("fp8_e4m3", KVQuantMode.FP8_PER_TENSOR),
        ("fp8", KVQuantMode.FP8_PER_TENSOR),
        ("auto", KVQuantMode.NONE),
        ("bfloat16", KVQuantMode.NONE),
    ],
)
def test_kv_quant_mode_from_cache_dtype(name, mode):
    assert get_kv_quant_mode(name) is mode
    assert is_quantized_kv_cache(name) == (mode is not KVQuantMode.NONE)
    assert KVQuantMode.FP8_PER_TOKEN_HEAD.is_per_token_head
    assert not KVQuantMode.FP8_PER_TENSOR.is_per_token_head
