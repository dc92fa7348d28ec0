"""Triton latent cache write: store each new token's ``[kv_c | k_pe]`` into one MLA layer's
paged cache view.

The view is kvcore's ``[B, 1, N, C]`` for an ``MLAAttentionSpec`` in any layout (or a
kernel-block split of one); the kernel addresses it only through its strides, so every layout
is the same code. Token t goes to slot ``slot_mapping[t]``, kernel block ``slot // N``, row
``slot % N``; slots of -1 are padding and write nothing. One program per token. The torch
reference is ``kernels.mla.reference.write_latent_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mla.base import as_latent_view, check_write_args


@triton.jit
def _store_row(src_ptr, dst_ptr, size, SIZE_PAD: tl.constexpr):
    # ``size`` is SIZE, or 0 for a padding token: a scalar & vector mask trips the
    # interpreter, so the skip rides on the bound instead.
    dims = tl.arange(0, SIZE_PAD)
    values = tl.load(src_ptr + dims, mask=dims < size)
    tl.store(dst_ptr + dims, values.to(dst_ptr.dtype.element_ty), mask=dims < size)


@triton.jit
def _latent_write_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    stride_ct, stride_pt,
    stride_cb, stride_cn,
    LATENT_SIZE: tl.constexpr, ROPE_SIZE: tl.constexpr,
    LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    KERNEL_BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    is_real = slot >= 0
    slot = tl.maximum(slot, 0)  # keeps a padding token's (unused) address in bounds
    block, row = slot // KERNEL_BLOCK_SIZE, slot % KERNEL_BLOCK_SIZE
    cell = cache_ptr + block * stride_cb + row * stride_cn
    _store_row(kv_c_ptr + token * stride_ct, cell, tl.where(is_real, LATENT_SIZE, 0), LATENT_PAD)
    _store_row(
        k_pe_ptr + token * stride_pt, cell + LATENT_SIZE, tl.where(is_real, ROPE_SIZE, 0),
        ROPE_PAD,
    )  # fmt: skip


def write_latent(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write kv_c ``[T, L]`` and k_pe ``[T, R]`` into ``kv_cache`` (``[B, 1, N, C]`` or
    ``[B, N, C]``, any strides) at ``slot_mapping`` ``[T]``; -1 skips a token."""
    check_write_args(kv_c, k_pe, slot_mapping)
    view = as_latent_view(kv_cache, kv_c.shape[1], k_pe.shape[1])
    if kv_c.shape[0] == 0:
        return
    # Rows are read as contiguous runs: [T, L] with a strided T is fine, a strided L is not.
    kv_c = kv_c if kv_c.stride(1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(1) == 1 else k_pe.contiguous()
    _latent_write_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, view, slot_mapping,
        kv_c.stride(0), k_pe.stride(0), view.stride(0), view.stride(2),
        **launch_constexprs(kv_c, k_pe, view),
    )  # fmt: skip


def launch_constexprs(
    kv_c: torch.Tensor, k_pe: torch.Tensor, view: torch.Tensor
) -> dict[str, object]:
    """The compile-time settings of one launch (the tests compile these ahead of time)."""
    latent_size, rope_size = kv_c.shape[1], k_pe.shape[1]
    return dict(
        LATENT_SIZE=latent_size,
        ROPE_SIZE=rope_size,
        LATENT_PAD=triton.next_power_of_2(latent_size),
        ROPE_PAD=triton.next_power_of_2(max(rope_size, 1)),
        KERNEL_BLOCK_SIZE=view.shape[2],
    )
