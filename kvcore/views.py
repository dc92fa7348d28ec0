"""Per-layer tensor views over one flat byte buffer. The only kvcore module that needs torch.

A worker allocates one raw ``int8`` buffer for its whole KV cache; every group's
``KVCacheTensor`` says where its layers live in it. The views made here are the only way the
model and the kernels reach the cache, so a layout is purely a matter of their strides.
"""

from __future__ import annotations

import torch

from kvcore.errors import KVCacheGeometryError
from kvcore.geometry import (
    KVCacheTensor,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
    max_byte_extent,
)
from kvcore.layout import KVCacheLayout
from kvcore.spec_base import KVCacheSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def create_kv_cache_views(
    raw: torch.Tensor,
    spec: KVCacheSpec,
    num_blocks: int,
    layout: KVCacheLayout | str,
    kv_cache_tensor: KVCacheTensor,
    kernel_block_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """One 4-D ``[B, H, N, C]`` view per layer of ``kv_cache_tensor``, in the spec's dtype.

    With ``kernel_block_size`` smaller than the spec's block, each manager block is seen as
    ``block_size // kernel_block_size`` kernel blocks (B grows, N shrinks); that needs every
    manager block to be one dense, unpadded page. Specs without a dtype (recurrent state) stay
    raw bytes for their layer to split.
    """
    layout = KVCacheLayout.parse(layout)
    if raw.dim() != 1 or raw.element_size() != 1:
        raise KVCacheGeometryError(
            f"The KV cache buffer must be a flat byte tensor, got shape {tuple(raw.shape)} "
            f"of {raw.dtype}."
        )
    num_layers = len(kv_cache_tensor.layers)
    block_stride = kv_cache_tensor.block_stride
    shape_bytes = compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size)
    ratio = shape_bytes[0] // num_blocks if num_blocks else 1
    layer_stride = kv_cache_tensor.layer_stride
    if ratio > 1:
        block_stride = _kernel_block_stride(spec, layout, block_stride, ratio, kernel_block_size)
        if num_layers == 1:
            # A lone layer's stride addresses nothing, but a layout with heads outside the layer
            # axis (BHLNC) would scale the heads from the manager block's: the kernel block's own.
            layer_stride = None
    strides = compute_layout_strides(
        spec,
        num_blocks,
        num_layers,
        layout,
        kernel_block_size,
        fixed_strides=(layer_stride, block_stride, None, None, None),
    )
    shape = (num_layers, *shape_bytes)
    end = kv_cache_tensor.offset + max_byte_extent(shape, strides)
    if end > raw.numel():
        raise KVCacheGeometryError(
            f"KV cache tensor for layers {kv_cache_tensor.layers} reaches byte {end}, but the "
            f"buffer holds {raw.numel()} bytes."
        )
    view5 = torch.as_strided(
        raw, shape, strides, storage_offset=raw.storage_offset() + kv_cache_tensor.offset
    )
    dtype_name = spec.view_dtype
    views = {}
    for index, layer_name in enumerate(kv_cache_tensor.layers):
        layer_view = view5[index]  # [B, H, N, C bytes]
        if dtype_name is not None:
            layer_view = _reinterpret(layer_view, dtype_name, layer_name)  # C bytes -> elements
        views[layer_name] = layer_view
    return views


def _kernel_block_stride(spec, layout, block_stride, ratio, kernel_block_size) -> int:
    dense_page = compute_layer_kv_cache_shape_bytes(spec, 1)
    dense_page = dense_page[1] * dense_page[2] * dense_page[3]  # H * N * C of one manager block
    if block_stride != dense_page:
        raise KVCacheGeometryError(
            f"The resolved KV cache layout ({layout.name}) does not store blocks as dense, "
            f"unpadded pages (block stride {block_stride} != page {dense_page}), so a manager "
            f"block cannot be split into {ratio} kernel blocks of {kernel_block_size} tokens. "
            f"Reduce --block-size to {kernel_block_size} or set the configured layout to a "
            "layer-compact layout (e.g. LBNHC)."
        )
    return block_stride // ratio


def _reinterpret(view: torch.Tensor, dtype_name: str, layer_name: str) -> torch.Tensor:
    dtype = TORCH_DTYPES[dtype_name]
    itemsize = dtype.itemsize
    byte_counts = (*view.stride()[:-1], view.storage_offset(), view.shape[-1])
    if any(count % itemsize for count in byte_counts):
        raise KVCacheGeometryError(
            f"Layer '{layer_name}': cannot read the cache as {dtype_name}; byte strides "
            f"{view.stride()}, offset {view.storage_offset()} and content {view.shape[-1]} "
            f"must all be multiples of {itemsize}."
        )
    return view.view(dtype)


def group_kernel_blocks(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[num_blocks * r, ...]`` kernel-block view -> ``[num_blocks, r, ...]``; no-op if r == 1."""
    if num_blocks <= 0 or cache.shape[0] % num_blocks != 0:
        raise KVCacheGeometryError(
            f"A cache of {cache.shape[0]} kernel blocks does not split into {num_blocks} "
            "manager blocks."
        )
    ratio = cache.shape[0] // num_blocks
    if ratio == 1:
        return cache
    return cache.unflatten(0, (num_blocks, ratio))
