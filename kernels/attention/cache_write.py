"""Triton cache write: store a step's new K and V into one layer's paged cache view.

The view is kvcore's ``[B, H, N, C]`` tensor in any of the six layouts (or a kernel-block
split of one); the kernel addresses it only through ``stride_c*``, so every layout is the same
code. Token t goes to slot ``slot_mapping[t]`` = ``block_id * block_size + offset``, which is
also ``kernel_block_id * N + offset`` of a split view, so N is the only geometry the kernel
needs. Slots of -1 mark padding tokens and are skipped. K fills ``C[:HEAD_SIZE]`` and V the
next ``HEAD_SIZE_V`` elements. The torch reference is
``kernels.attention.reference.write_kv_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.cache_view import check_kv_cache


@triton.jit
def _store_heads(
    src_ptr,
    dst_ptr,
    token,
    heads,
    is_row,
    stride_st,
    stride_sh,
    stride_sd,
    stride_cc,
    content_start,
    SIZE: tl.constexpr,
    SIZE_PAD: tl.constexpr,
):
    # One token's [BLOCK_H, SIZE] slab from a [T, H, SIZE] tensor into cells at dst_ptr[h].
    dims = tl.arange(0, SIZE_PAD)
    mask = is_row[:, None] & (dims < SIZE)[None, :]
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh + dims[None, :] * stride_sd
    values = tl.load(src, mask=mask)
    dst = dst_ptr[:, None] + (content_start + dims[None, :]).to(tl.int64) * stride_cc
    tl.store(dst, values.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _cache_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ch,
    stride_cn,
    stride_cc,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_V_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KERNEL_BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Padding tokens (slot -1) write nothing: they see zero heads. (A scalar & vector mask
    # trips the interpreter, hence the where.)
    is_row = heads < tl.where(slot >= 0, num_kv_heads, 0)
    block = slot // KERNEL_BLOCK_SIZE
    offset = slot % KERNEL_BLOCK_SIZE
    cells = cache_ptr + block * stride_cb + heads.to(tl.int64) * stride_ch + offset * stride_cn
    _store_heads(
        key_ptr, cells, token, heads, is_row, stride_kt, stride_kh, stride_kd, stride_cc, 0,
        HEAD_SIZE, HEAD_PAD,
    )  # fmt: skip
    _store_heads(
        value_ptr, cells, token, heads, is_row, stride_vt, stride_vh, stride_vd, stride_cc,
        HEAD_SIZE, HEAD_SIZE_V, HEAD_V_PAD,
    )  # fmt: skip


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K ``[T, H, head_size]`` and V ``[T, H, head_size_v]`` into ``kv_cache`` at the
    slots of ``slot_mapping`` ``[T]`` (-1 skips a token). Any strides, any layout."""
    num_tokens, num_kv_heads, head_size = key.shape
    head_size_v = value.shape[-1]
    check_kv_cache(kv_cache, num_kv_heads, head_size, head_size_v)
    if value.shape[:2] != key.shape[:2] or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must agree on tokens and heads."
        )
    if num_tokens == 0:
        return
    constexprs = launch_constexprs(key, value, kv_cache)
    grid = (num_tokens, triton.cdiv(num_kv_heads, constexprs["BLOCK_H"]))
    _cache_write_kernel[grid](
        key, value, kv_cache, slot_mapping, num_kv_heads,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        **constexprs,
    )  # fmt: skip


def launch_constexprs(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor
) -> dict[str, object]:
    """The compile-time settings of one launch (the tests compile these ahead of time)."""
    head_size, head_size_v = key.shape[-1], value.shape[-1]
    return dict(
        HEAD_SIZE=head_size,
        HEAD_SIZE_V=head_size_v,
        HEAD_PAD=triton.next_power_of_2(head_size),
        HEAD_V_PAD=triton.next_power_of_2(max(head_size_v, 1)),
        BLOCK_H=min(triton.next_power_of_2(key.shape[1]), 16),
        KERNEL_BLOCK_SIZE=kv_cache.shape[2],
    )
