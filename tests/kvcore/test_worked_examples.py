"""The worked examples E1-E9 of reference §3.4, with their exact numbers."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kvcore import (
    FullAttentionSpec,
    KVCacheGeometryError,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    build_kv_cache_tensor,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
    create_kv_cache_views,
    group_kernel_blocks,
)

BF16_8x128 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


def raw_buffer(num_bytes: int) -> torch.Tensor:
    return torch.zeros(num_bytes, dtype=torch.int8)


def test_e1_page_bytes_and_view_shape():
    spec = BF16_8x128
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (8, 16, 512)
    assert spec.page_size_bytes == 65_536
    tensor = build_kv_cache_tensor(spec, ["layer.0"], 3, "LBHNC")
    view = create_kv_cache_views(raw_buffer(tensor.size), spec, 3, "LBHNC", tensor)["layer.0"]
    assert view.dtype == torch.bfloat16
    assert tuple(view.shape) == (3, 8, 16, 256)


E2_STRIDES = {
    "LBHNC": (6_553_600, 65_536, 8_192, 512, 1),
    "LBNHC": (6_553_600, 65_536, 512, 4_096, 1),
    "LHBNC": (6_553_600, 8_192, 819_200, 512, 1),
    "BLHNC": (65_536, 262_144, 8_192, 512, 1),
    "BLNHC": (65_536, 262_144, 512, 4_096, 1),
    "BHLNC": (8_192, 262_144, 32_768, 512, 1),
}


@pytest.mark.parametrize("layout", list(E2_STRIDES))
def test_e2_strides_for_every_layout(layout):
    strides = compute_layout_strides(BF16_8x128, 100, 4, layout)
    assert strides == E2_STRIDES[layout]
    tensor = build_kv_cache_tensor(BF16_8x128, [f"l{i}" for i in range(4)], 100, layout)
    assert tensor.size == 4 * 100 * 65_536
    views = create_kv_cache_views(raw_buffer(tensor.size), BF16_8x128, 100, layout, tensor)
    # After .view(bf16) every element stride is the byte stride / 2.
    assert views["l2"].stride() == (*tuple(s // 2 for s in strides[1:4]), 1)
    assert views["l2"].storage_offset() == 2 * strides[0] // 2


def test_e2_block_bytes_in_lhbnc_and_bhlnc():
    # LHBNC scatters a block over L x H planes; BHLNC keeps a block as one 262,144-byte run,
    # but one layer's page inside it is not contiguous.
    assert not KVCacheLayout.LHBNC.is_block_compact
    assert KVCacheLayout.BHLNC.is_block_outermost and not KVCacheLayout.BHLNC.is_block_compact
    l_stride, b_stride, h_stride, _, _ = E2_STRIDES["BHLNC"]
    assert b_stride == 262_144 and h_stride > l_stride


MLA_656 = MLAAttentionSpec(
    block_size=64,
    num_kv_heads=1,
    head_size=576,
    dtype="uint8",
    state_content_bytes=656,
    alignment=4096,
)

E3_STRIDES = {
    "LBNHC": (450_560, 45_056, 656, 656, 1),
    "BLHNC": (45_056, 90_112, 41_984, 656, 1),
    "LHBNC": (450_560, 45_056, 450_560, 656, 1),
    "BHLNC": (45_056, 90_112, 90_112, 656, 1),
}


def test_e3_padded_mla_page():
    assert MLA_656.unpadded_page_size_bytes == 41_984
    assert MLA_656.page_size_padded == MLA_656.page_size_bytes == 45_056


@pytest.mark.parametrize("layout", list(E3_STRIDES))
def test_e3_padded_strides(layout):
    assert compute_layout_strides(MLA_656, 10, 2, layout) == E3_STRIDES[layout]


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_e3_padding_with_many_heads_outside_the_page_tail_is_refused(layout):
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype="float16", page_size_padded=1024
    )
    with pytest.raises(KVCacheGeometryError, match="outside the page tail"):
        compute_layout_strides(spec, 10, 2, layout)


def test_e3_padded_page_view_keeps_blocks_contiguous():
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=2, dtype="float32", page_size_padded=384
    )
    assert spec.unpadded_page_size_bytes == 256
    tensor = build_kv_cache_tensor(spec, ["l"], 5, "LBHNC")
    view = create_kv_cache_views(raw_buffer(tensor.size), spec, 5, "LBHNC", tensor)["l"]
    assert tuple(view.shape) == (5, 1, 16, 4)
    assert view.stride(0) == 384 // 4
    assert view[0].is_contiguous()


def test_e3_padding_refuses_kernel_split():
    with pytest.raises(KVCacheGeometryError, match="do not support kernel block splitting"):
        compute_layout_strides(MLA_656, 10, 2, "LBNHC", kernel_block_size=16)


SPEC_64 = FullAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype="bfloat16")
PAGE_64 = 262_144


def split_tensor(num_layers: int, layout: str) -> KVCacheTensor:
    return build_kv_cache_tensor(SPEC_64, [f"l{i}" for i in range(num_layers)], 100, layout)


@pytest.mark.parametrize(
    ("layout", "strides"),
    [
        ("LBHNC", (26_214_400, 65_536, 8_192, 512, 1)),
        ("LBNHC", (26_214_400, 65_536, 512, 4_096, 1)),
    ],
)
def test_e4_kernel_block_split(layout, strides):
    assert SPEC_64.page_size_bytes == PAGE_64
    assert compute_layer_kv_cache_shape_bytes(SPEC_64, 100, 16) == (400, 8, 16, 512)
    tensor = split_tensor(1, layout)
    assert (tensor.layer_stride, tensor.block_stride) == (PAGE_64 * 100, PAGE_64)
    raw = raw_buffer(tensor.size)
    view = create_kv_cache_views(raw, SPEC_64, 100, layout, tensor, kernel_block_size=16)["l0"]
    assert tuple(view.shape) == (400, 8, 16, 256)
    assert view.stride() == (*tuple(s // 2 for s in strides[1:4]), 1)
    grouped = group_kernel_blocks(view, 100)
    assert tuple(grouped.shape) == (100, 4, 8, 16, 256)
    # Kernel block k of manager block b sits at b * 262,144 + k * 65,536 bytes.
    base = raw.data_ptr()
    assert grouped[7, 3].data_ptr() - base == 7 * PAGE_64 + 3 * 65_536


def test_e4_split_refused_in_blhnc_with_two_layers_allowed_with_one():
    tensor = split_tensor(2, "BLHNC")
    assert tensor.block_stride == 524_288
    with pytest.raises(KVCacheGeometryError) as info:
        create_kv_cache_views(raw_buffer(tensor.size), SPEC_64, 100, "BLHNC", tensor, 16)
    message = str(info.value)
    for fragment in ("BLHNC", "524288", "262144", "Reduce --block-size to 16", "LBNHC"):
        assert fragment in message
    single = split_tensor(1, "BLHNC")
    views = create_kv_cache_views(raw_buffer(single.size), SPEC_64, 100, "BLHNC", single, 16)
    assert tuple(views["l0"].shape) == (400, 8, 16, 256)


def test_e5_compressed_states():
    spec = MLAAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=128, dtype="bfloat16", tokens_per_state=4
    )
    assert (spec.num_states, spec.state_content_size_bytes) == (64, 256)
    assert spec.page_size_bytes == 16_384
    tensor = build_kv_cache_tensor(spec, ["mla"], 4, "LBHNC")
    raw = raw_buffer(tensor.size)
    for kernel_block_size in (None, 256):
        view = create_kv_cache_views(raw, spec, 4, "LBHNC", tensor, kernel_block_size)["mla"]
        assert tuple(view.shape) == (4, 1, 64, 128) and view.dtype == torch.bfloat16
    view = create_kv_cache_views(raw, spec, 4, "LBHNC", tensor, 64)["mla"]
    assert tuple(view.shape) == (16, 1, 16, 128)


def test_e5b_fractional_tokens_per_state():
    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=8,
        dtype="float16",
        tokens_per_state=Fraction(1, 4),
    )
    assert spec.num_states == 64
    assert spec.page_size_bytes == 2 * 64 * 32


def test_e6_mamba_page_and_view():
    spec = MambaSpec(block_size=1, shapes=((2,), (4,)), dtypes=("float32", "float16"))
    assert spec.page_size_bytes == 16
    tensor = KVCacheTensor(size=96, layers=["ssm"], layer_stride=16, block_stride=32, offset=8)
    raw = raw_buffer(96)
    view = create_kv_cache_views(raw, spec, 3, "BLHNC", tensor)["ssm"]
    assert view.dtype == torch.int8
    assert tuple(view.shape) == (3, 1, 1, 16)
    assert view.stride() == (32, 16, 16, 1)
    assert view.data_ptr() == raw.data_ptr() + 8
    view.fill_(1)
    touched = raw.view(3, 32) != 0
    assert touched[:, 8:24].all() and not touched[:, :8].any() and not touched[:, 24:].any()


def test_e7_sliding_window_admission():
    from kvcore import SlidingWindowSpec

    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=4096
    )
    assert spec.max_admission_blocks_per_request(8192, 131_072) == 769


def test_e8_packed_block_outermost_tensors():
    main = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, head_size_v=16, dtype="bfloat16"
    )
    compressed = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=16, dtype="bfloat16", tokens_per_state=4
    )
    fixed = (None, 6_528, None, None, None)
    assert compute_layout_strides(main, 10, 3, "BLNHC", fixed_strides=fixed) == (
        2_048,
        6_528,
        64,
        128,
        1,
    )
    assert compute_layout_strides(compressed, 10, 3, "BLNHC", fixed_strides=fixed) == (
        128,
        6_528,
        32,
        32,
        1,
    )
    size = 6_528 * 10
    main_t = build_kv_cache_tensor(
        main, ["m0", "m1", "m2"], 10, "BLNHC", block_stride=6_528, size=size
    )
    comp_t = build_kv_cache_tensor(
        compressed, ["c0", "c1", "c2"], 10, "BLNHC", block_stride=6_528, offset=6_144, size=size
    )
    raw = raw_buffer(size)
    views = {
        **create_kv_cache_views(raw, main, 10, "BLNHC", main_t),
        **create_kv_cache_views(raw, compressed, 10, "BLNHC", comp_t),
    }
    for index, view in enumerate(views.values()):
        view.view(torch.int16).fill_((index + 1) * 0x0101)  # both bytes non-zero
    # Every byte of every packed block belongs to exactly one layer: none is left zero.
    assert (raw.view(10, 6_528) != 0).all()
    assert views["c0"].data_ptr() - raw.data_ptr() == 6_144


def test_e9_one_layout_two_allocations():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    page = spec.page_size_bytes
    assert page == 8_192
    num_blocks = (8 * 1024 * 1024) // (4 * page)
    assert num_blocks == 256
    layers = [f"l{i}" for i in range(4)]
    lbnhc = build_kv_cache_tensor(spec, layers, num_blocks, "LBNHC")
    blhnc = build_kv_cache_tensor(spec, layers, num_blocks, "BLHNC")
    assert (lbnhc.layer_stride, lbnhc.block_stride) == (page * 256, page)
    assert (blhnc.layer_stride, blhnc.block_stride) == (page, 4 * page)
    assert lbnhc.size == blhnc.size == 8 * 1024 * 1024
