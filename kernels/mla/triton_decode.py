"""Triton MLA decode with absorbed weights: split-KV flash decoding over the paged latent cache.

Every query head of a request attends to the same latent row per token (MQA with one KV head),
keys ``[kv_c | k_pe]`` and values ``kv_c``, a prefix of the same row, so each latent tile is
loaded once and used for both products. Two launches:

1. ``_decode_split_kernel``, one program per (request, ``BLOCK_H`` query heads, split): the
   split's slice of the context in tiles of ``TILE_N`` positions with an online softmax in fp32,
   leaving the split's normalised output and its log-sum-exp (log2 units) in a workspace. Split
   s of a context of n tokens covers ``[s * len, min((s + 1) * len, n))`` with
   ``len = cdiv(cdiv(n, num_splits), TILE_N) * TILE_N``; a split past the end is empty and
   records lse -inf and zeros.
2. ``_merge_splits_kernel``, one program per (request, head): the splits' outputs weighted by
   their softmax mass, ``Σ 2^lse_s o_s / Σ 2^lse_s``.

A position reaches the cache as in ``kernels.attention.paged_attention``: block table, slot,
kernel block and row, then the view's strides, so every layout and kernel-block split takes the
same path.
The torch reference is ``kernels.mla.reference.mla_decode_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mla.base import DEFAULT_NUM_SPLITS, as_latent_view, check_decode_args
from kernels.triton_support import TL_DTYPES, dot_constexprs

LOG2E = 1.4426950408889634
# Query heads per program: all share every latent load; tl.dot needs 16 rows on GPUs.
BLOCK_H = 16
TILE_N = 32  # context positions per step


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width changes every step
def _decode_split_kernel(
    q_latent_ptr, q_pe_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
    partial_out_ptr, partial_lse_ptr,
    num_heads, scale_log2,
    stride_qr, stride_qh, stride_qd,
    stride_pr, stride_ph, stride_pd,
    stride_cb, stride_cn,
    stride_bt,
    stride_wr, stride_wh, stride_ws,
    stride_lr, stride_lh,
    LATENT_SIZE: tl.constexpr, ROPE_SIZE: tl.constexpr,
    LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KERNEL_BLOCK_SIZE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), TILE_N) * TILE_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    is_head = heads < num_heads
    dims = tl.arange(0, LATENT_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    is_latent_dim = dims < LATENT_SIZE
    is_rope_dim = rope_dims < ROPE_SIZE
    q_rows = q_latent_ptr + req * stride_qr + heads[:, None] * stride_qh
    q_latent = tl.load(q_rows + dims[None, :] * stride_qd,
                       mask=is_head[:, None] & is_latent_dim[None, :], other=0.0)  # fmt: skip
    pe_rows = q_pe_ptr + req * stride_pr + heads[:, None] * stride_ph
    q_pe = tl.load(pe_rows + rope_dims[None, :] * stride_pd,
                   mask=is_head[:, None] & is_rope_dim[None, :], other=0.0)  # fmt: skip
    # Products run in COMPUTE_DTYPE: the cache dtype on GPUs, fp32 under the interpreter.
    q_latent = q_latent.to(COMPUTE_DTYPE)  # [BLOCK_H, LATENT_PAD]
    q_pe = q_pe.to(COMPUTE_DTYPE)  # [BLOCK_H, ROPE_PAD]

    row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    block_row_ptr = block_table_ptr + req * stride_bt
    for key_start in range(split_start, split_end, TILE_N):
        key_pos = key_start + tl.arange(0, TILE_N)
        is_key = key_pos < split_end
        block = tl.load(block_row_ptr + key_pos // BLOCK_SIZE, mask=is_key, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE
        cells = (slot // KERNEL_BLOCK_SIZE) * stride_cb + (slot % KERNEL_BLOCK_SIZE) * stride_cn
        cells = cache_ptr + cells  # [TILE_N] row starts
        latent = tl.load(cells[:, None] + dims[None, :],
                         mask=is_key[:, None] & is_latent_dim[None, :], other=0.0)  # fmt: skip
        latent = latent.to(COMPUTE_DTYPE)  # [TILE_N, LATENT_PAD]: keys' first part and values
        rope = tl.load(cells[:, None] + LATENT_SIZE + rope_dims[None, :],
                       mask=is_key[:, None] & is_rope_dim[None, :], other=0.0)  # fmt: skip
        rope = rope.to(COMPUTE_DTYPE)  # [TILE_N, ROPE_PAD]
        logits = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        logits += tl.dot(q_pe, tl.trans(rope), input_precision=DOT_PRECISION)
        logits = tl.where(is_key[None, :], logits * scale_log2, float("-inf"))  # [BLOCK_H, TILE_N]

        # Every tile holds a real key, so new_max is finite from the first tile on.
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        probs = tl.exp2(logits - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        pv = tl.dot(probs.to(COMPUTE_DTYPE), latent, input_precision=DOT_PRECISION)
        acc = acc * rescale[:, None] + pv
        row_max = new_max

    # An empty split (past the end of a short context) saw nothing: zeros with lse -inf.
    is_seen = row_sum > 0
    out = acc / tl.where(is_seen, row_sum, 1.0)[:, None]
    lse = tl.where(is_seen, row_max + tl.log2(tl.where(is_seen, row_sum, 1.0)), float("-inf"))
    w_rows = partial_out_ptr + req * stride_wr + heads[:, None] * stride_wh + split * stride_ws
    tl.store(w_rows + dims[None, :], out, mask=is_head[:, None] & is_latent_dim[None, :])
    tl.store(partial_lse_ptr + req * stride_lr + heads * stride_lh + split, lse, mask=is_head)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    num_splits,
    stride_wr, stride_wh, stride_ws,
    stride_lr, stride_lh,
    stride_or, stride_oh, stride_od,
    LATENT_SIZE: tl.constexpr, LATENT_PAD: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, LATENT_PAD)
    is_dim = dims < LATENT_SIZE
    w_row = partial_out_ptr + req * stride_wr + head * stride_wh
    lse_row = partial_lse_ptr + req * stride_lr + head * stride_lh
    row_max = tl.full([], float("-inf"), tl.float32)  # tensors, not constants: the loop carries
    row_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([LATENT_PAD], tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(lse_row + split)
        new_max = tl.maximum(row_max, lse)
        # Until a split has seen a key the max is -inf; shift by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weight = tl.exp2(lse - shift)
        rescale = tl.exp2(row_max - shift)
        part = tl.load(w_row + split * stride_ws + dims, mask=is_dim, other=0.0)
        acc = acc * rescale + weight * part
        row_sum = row_sum * rescale + weight
        row_max = new_max
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)  # no context at all: zeros
    o_ptrs = out_ptr + req * stride_or + head * stride_oh + dims * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=is_dim)


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    num_splits: int = DEFAULT_NUM_SPLITS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode (contract: ``MLABackend.decode``): q_latent ``[R, Hq, L]``, q_pe
    ``[R, Hq, Rd]`` over ``kv_cache`` ``[B, 1, N, C]`` -> ``[R, Hq, L]`` in q_latent's dtype."""
    check_decode_args(q_latent, q_pe, block_table, seq_lens, num_splits, out)
    num_reqs, num_heads, latent_size = q_latent.shape
    view = as_latent_view(kv_cache, latent_size, q_pe.shape[-1])
    if view.dtype not in TL_DTYPES:
        raise ValueError(f"mla_decode reads fp32/bf16/fp16 caches, not {view.dtype}.")
    if out is None:
        out = torch.empty_like(q_latent)
    if num_reqs == 0:
        return out
    partial_out, partial_lse = new_split_workspace(
        num_reqs, num_heads, num_splits, latent_size, q_latent.device
    )
    constexprs = split_constexprs(q_latent, q_pe, view, block_size)
    grid = (num_reqs, triton.cdiv(num_heads, constexprs["BLOCK_H"]), num_splits)
    _decode_split_kernel[grid](
        q_latent, q_pe, view, block_table, seq_lens, partial_out, partial_lse,
        num_heads, scale * LOG2E,
        *q_latent.stride(), *q_pe.stride(), view.stride(0), view.stride(2),
        block_table.stride(0), *partial_out.stride()[:3], *partial_lse.stride()[:2],
        **constexprs,
    )  # fmt: skip
    _merge_splits_kernel[(num_reqs, num_heads)](
        partial_out, partial_lse, out, num_splits,
        *partial_out.stride()[:3], *partial_lse.stride()[:2], *out.stride(),
        LATENT_SIZE=latent_size, LATENT_PAD=constexprs["LATENT_PAD"],
    )  # fmt: skip
    return out


def new_split_workspace(
    num_reqs: int, num_heads: int, num_splits: int, latent_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split outputs ``[R, Hq, S, L]`` and log-sum-exps ``[R, Hq, S]``, fp32. Stage 1 writes
    every element stage 2 reads, so they start uninitialised."""
    partial_out = torch.empty(
        (num_reqs, num_heads, num_splits, latent_size), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return partial_out, partial_lse


def split_constexprs(
    q_latent: torch.Tensor, q_pe: torch.Tensor, view: torch.Tensor, block_size: int
) -> dict[str, object]:
    """The compile-time settings of the split kernel's launch."""
    return dict(
        LATENT_SIZE=q_latent.shape[-1],
        ROPE_SIZE=q_pe.shape[-1],
        LATENT_PAD=_dot_size(q_latent.shape[-1]),
        ROPE_PAD=_dot_size(q_pe.shape[-1]),
        BLOCK_H=BLOCK_H,
        TILE_N=TILE_N,
        BLOCK_SIZE=block_size,
        KERNEL_BLOCK_SIZE=view.shape[2],
        **dot_constexprs(view.dtype),
    )


def _dot_size(size: int) -> int:
    # tl.dot needs every dimension to be a power of two and at least 16 on GPUs.
    return max(16, triton.next_power_of_2(size))
