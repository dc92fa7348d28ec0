"""Property-based checks of the views ``create_kv_cache_views`` makes over one byte buffer.

For random specs, all six layouts, 1-4 layers and several block counts: every cell of every
(layer, block) page is written through the typed views, then the raw buffer is read back. Each
cell must sit at ``offset + l*layer_stride + b*block_stride + h*H_stride + n*N_stride``, no two
cells may share a byte, no byte outside the cells may change, and the layout's promises
(layer-compact, block-compact, block-outermost) must hold. Kernel-block splits must address the
same bytes as the unsplit view.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcore import (
    DTYPE_SIZES,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheGeometryError,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
    create_kv_cache_views,
    group_kernel_blocks,
)
from kvcore.geometry import max_byte_extent

DTYPES = sorted(DTYPE_SIZES)
ALIGN = 8  # extra strides and offsets keep every dtype's element alignment


@st.composite
def attention_specs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tokens_per_state = draw(
        st.sampled_from([t for t in (1, 2, 4, Fraction(1, 2)) if block_size % t == 0])
    )
    cls = draw(st.sampled_from(["full", "swa", "ring", "mla"]))
    fields = dict(
        block_size=block_size,
        num_kv_heads=1 if cls == "mla" else draw(st.integers(1, 3)),
        head_size=draw(st.integers(1, 6)),
        dtype=draw(st.sampled_from(DTYPES)),
        tokens_per_state=tokens_per_state,
    )
    if cls != "mla":
        fields["head_size_v"] = draw(st.integers(0, 6))
    spec = {
        "full": lambda: FullAttentionSpec(**fields),
        "swa": lambda: SlidingWindowSpec(**fields, sliding_window=draw(st.integers(1, 64))),
        "ring": lambda: CircularBufferSpec(**fields),
        "mla": lambda: MLAAttentionSpec(**fields),
    }[cls]()
    if draw(st.booleans()):
        return spec
    padded = spec.unpadded_page_size_bytes + ALIGN * draw(st.integers(1, 4))
    padded += -padded % ALIGN
    return type(spec)(**{**_fields(spec), "page_size_padded": padded})


@st.composite
def mamba_specs(draw):
    num_states = draw(st.integers(1, 2))
    shapes = tuple(
        tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))) for _ in range(num_states)
    )
    dtypes = tuple(draw(st.sampled_from(DTYPES)) for _ in range(num_states))
    spec = MambaSpec(block_size=draw(st.sampled_from([1, 4, 16])), shapes=shapes, dtypes=dtypes)
    if draw(st.booleans()):
        return MambaSpec(**{**_fields(spec), "page_size_padded": spec.page_size_bytes + 24})
    return spec


def _fields(spec):
    return {name: getattr(spec, name) for name in type(spec).__struct_fields__}


geometry = st.fixed_dictionaries(
    {
        "spec": st.one_of(attention_specs(), mamba_specs()),
        "layout": st.sampled_from(list(KVCacheLayout)),
        "num_layers": st.integers(1, 4),
        "num_blocks": st.sampled_from([1, 2, 3, 5]),
        "offset": st.sampled_from([0, 8, 24]),
        "outer_pad": st.sampled_from([0, 8, 40]),
    }
)


def cell_positions(shape, strides, offset) -> np.ndarray:
    """Byte address of every (l, b, h, n, c), by the formula, shape ``[L, B, H, N, C]``."""
    grids = np.meshgrid(*[np.arange(d) for d in shape], indexing="ij")
    return offset + sum(g * s for g, s in zip(grids, strides, strict=True))


def plan(case):
    """Strides with the outermost physical axis widened by ``outer_pad`` (a packed plan)."""
    spec, layout = case["spec"], case["layout"]
    natural = compute_layout_strides(spec, case["num_blocks"], case["num_layers"], layout)
    outer = layout.stride_order[0]
    fixed = [None] * 5
    fixed[outer] = natural[outer] + case["outer_pad"]
    return compute_layout_strides(
        spec, case["num_blocks"], case["num_layers"], layout, fixed_strides=tuple(fixed)
    )


def is_refused_padding(case) -> bool:
    spec, layout = case["spec"], case["layout"]
    return spec.page_size_padded is not None and spec.num_heads > 1 and not layout.is_block_compact


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.view(torch.uint8)  # [B, H, N, C elements] -> [B, H, N, C bytes]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=geometry, seed=st.integers(0, 2**31 - 1))
def test_views_address_exactly_the_planned_bytes(case, seed):
    spec, layout = case["spec"], case["layout"]
    num_layers, num_blocks, offset = case["num_layers"], case["num_blocks"], case["offset"]
    if is_refused_padding(case):
        with pytest.raises(KVCacheGeometryError, match="outside the page tail"):
            plan(case)
        return
    strides = plan(case)
    shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, num_blocks))
    positions = cell_positions(shape, strides, offset)
    assert np.unique(positions).size == positions.size, "two cells share a byte"

    size = offset + max_byte_extent(shape, strides) + ALIGN
    layers = [f"layer.{i}" for i in range(num_layers)]
    tensor = KVCacheTensor(size, layers, strides[0], strides[1], offset)
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    assert list(views) == layers

    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 256, shape, dtype=torch.uint8, generator=generator)
    for index, name in enumerate(layers):
        view = views[name]
        expected_dtype = spec.view_dtype or "int8"
        assert view.dtype == getattr(torch, expected_dtype)
        as_bytes(view).copy_(codes[index])

    memory = raw.view(torch.uint8).numpy()
    np.testing.assert_array_equal(memory[positions], codes.numpy())
    untouched = np.ones(size, dtype=bool)
    untouched[positions.ravel()] = False
    assert not memory[untouched].any(), "a write landed outside every cell"
    _check_layout_promises(layout, positions, strides, offset, shape)


def _check_layout_promises(layout, positions, strides, offset, shape) -> None:
    num_layers, num_blocks = shape[:2]
    page_bytes = shape[2] * shape[3] * shape[4]
    for layer in range(num_layers):
        for block in range(num_blocks):
            page = np.sort(positions[layer, block].ravel())
            if layout.is_block_compact:
                start = page[0]
                np.testing.assert_array_equal(page, np.arange(start, start + page_bytes))
            if layout.is_layer_compact:
                lo = offset + layer * strides[0]
                assert lo <= page[0] and page[-1] < lo + strides[0]
            if layout.is_block_outermost:
                lo = offset + block * strides[1]
                assert lo <= page[0] and page[-1] < lo + strides[1]


def byte_addresses(view: torch.Tensor, raw: torch.Tensor) -> np.ndarray:
    """Sorted byte offsets (from the start of ``raw``) of every byte ``view`` addresses."""
    view = as_bytes(view)
    base = view.data_ptr() - raw.data_ptr()
    addresses = cell_positions(tuple(view.shape), view.stride(), base)
    return np.sort(addresses.ravel())


def kernel_block_sizes(spec) -> list[int]:
    return [
        k
        for k in range(1, spec.block_size)
        if spec.block_size % k == 0 and (Fraction(k) / spec.tokens_per_state).denominator == 1
    ]


@settings(max_examples=150, deadline=None)
@given(case=geometry)
@example(  # heads outside the layer axis, one layer: the split's heads once overran the page
    case={
        "spec": FullAttentionSpec(
            block_size=2, num_kv_heads=2, head_size=1, head_size_v=0, dtype="bfloat16"
        ),
        "layout": KVCacheLayout.BHLNC,
        "num_layers": 1,
        "num_blocks": 1,
        "offset": 0,
        "outer_pad": 0,
    }
)
def test_kernel_block_splits_address_the_same_bytes(case):
    """A split is allowed only over dense pages; then kernel block k of manager block b is the
    k-th equal slice of b's page, and the kernel blocks of b cover exactly b's bytes."""
    spec, layout, num_blocks = case["spec"], case["layout"], case["num_blocks"]
    if isinstance(spec, MambaSpec) or spec.page_size_padded is not None:
        return
    strides = plan(case)
    shape = (case["num_layers"], *compute_layer_kv_cache_shape_bytes(spec, num_blocks))
    layers = [f"layer.{i}" for i in range(case["num_layers"])]
    tensor = KVCacheTensor(
        case["offset"] + max_byte_extent(shape, strides),
        layers,
        strides[0],
        strides[1],
        case["offset"],
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    whole = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    page = spec.unpadded_page_size_bytes
    for kernel_block_size in kernel_block_sizes(spec):
        if tensor.block_stride != page:
            refusal = f"Reduce --block-size to {kernel_block_size}"
            with pytest.raises(KVCacheGeometryError, match=refusal):
                create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size)
            continue
        split = create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size)
        ratio = spec.block_size // kernel_block_size
        for name, unsplit in whole.items():
            grouped = group_kernel_blocks(split[name], num_blocks)  # [B, r, H, Nk, C]
            assert tuple(grouped.shape[:2]) == (num_blocks, ratio)
            for block in range(num_blocks):
                manager_bytes = byte_addresses(unsplit[block], raw)
                np.testing.assert_array_equal(byte_addresses(grouped[block], raw), manager_bytes)
                for k in range(ratio):
                    chunk = manager_bytes[0] + np.arange(k * page // ratio, (k + 1) * page // ratio)
                    np.testing.assert_array_equal(byte_addresses(grouped[block, k], raw), chunk)
