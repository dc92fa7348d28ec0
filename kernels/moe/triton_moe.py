"""Triton fused mixture-of-experts: the routed (token, choice) pairs sorted by expert into
blocks of ``BLOCK_M`` rows of one expert each, then two grouped GEMMs over those blocks.

1. ``_gate_up_kernel``, one program per (row block, ``BLOCK_N`` intermediate columns): the
   block's tokens times its expert's gate and up rows, both accumulated in fp32 from the same
   loads of the tokens (plus their biases, gpt-oss's), and ``act(gate) * up`` stored to the
   intermediate buffer (``act(up)`` for ungated experts, which have up rows only; act is SiLU,
   relu² or gpt-oss's clamped SwiGLU).
2. ``_down_kernel``, one program per (row block, ``BLOCK_N`` hidden columns): the intermediate
   rows times the expert's down projection, scaled by the pair's router weight, stored to the
   pair's row of an fp32 buffer; each token's ``top_k`` rows are then summed in torch.

The sorting (``align_by_expert``) runs in torch on the device without reading anything back to
the host: its buffers are sized for the worst case (every expert's block padded), and a block
past the experts' rows names no expert and returns at once, so neither grid nor kernels change
with the routing, and one compile serves every step. Pairs routed to an expert held by another
rank (ids >= the local expert count, under expert parallelism) get no row and add nothing.
The torch reference is ``kernels.moe.reference.grouped_experts``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.reference import ACTIVATIONS, GATED_SILU, ExpertKind
from kernels.triton_support import dot_constexprs

BLOCK_M = 16  # pairs per row block: tl.dot needs 16 rows on GPUs
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _gate_up_kernel(
    hidden_ptr, w13_ptr, b13_ptr, inter_ptr, sorted_pairs_ptr, block_expert_ptr,
    inter_size, hidden_size, top_k, alpha, limit,
    stride_ht, stride_hh,
    stride_we, stride_wn, stride_wk,
    stride_be,
    stride_ir, stride_ic,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    is_pair = pairs >= 0
    tokens = tl.where(is_pair, pairs // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < inter_size
    # Gated: the first I rows are the gates, the next I the ups; ungated: the ups alone.
    first_rows = w13_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_rows = first_rows + inter_size * stride_wn
    acc_first = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, hidden_size, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        is_k = ks < hidden_size
        x = tl.load(hidden_ptr + tokens[:, None] * stride_ht + ks[None, :] * stride_hh,
                    mask=is_pair[:, None] & is_k[None, :], other=0.0).to(COMPUTE_DTYPE)  # fmt: skip
        w_mask = is_k[:, None] & is_col[None, :]
        first = tl.load(first_rows + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_first += tl.dot(x, first.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(up_rows + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
            acc_up += tl.dot(x, up.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias_row = b13_ptr + expert * stride_be + cols
        acc_first += tl.load(bias_row, mask=is_col, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + inter_size, mask=is_col, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:  # relu²
        act = tl.maximum(acc_first, 0.0)
        act = act * act
    elif ACTIVATION == 2:  # gpt-oss's clamped SwiGLU
        gate = tl.minimum(acc_first, limit)
        act = gate * tl.sigmoid(gate * alpha)
    else:  # SiLU
        act = acc_first * tl.sigmoid(acc_first)
    if GATED:
        if ACTIVATION == 2:
            act = act * (tl.minimum(tl.maximum(acc_up, -limit), limit) + 1.0)
        else:
            act = act * acc_up
    out = inter_ptr + rows[:, None].to(tl.int64) * stride_ir + cols[None, :] * stride_ic
    tl.store(out, act.to(inter_ptr.dtype.element_ty), mask=is_pair[:, None] & is_col[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w2_ptr, b2_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
    hidden_size, inter_size,
    stride_ir, stride_ic,
    stride_we, stride_wn, stride_wk,
    stride_be,
    stride_op, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    is_pair = pairs >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < hidden_size
    inter_rows = inter_ptr + rows[:, None].to(tl.int64) * stride_ir
    w_rows = w2_ptr + expert * stride_we + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inter_size, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        is_k = ks < inter_size
        a = tl.load(inter_rows + ks[None, :] * stride_ic,
                    mask=is_pair[:, None] & is_k[None, :], other=0.0).to(COMPUTE_DTYPE)  # fmt: skip
        w = tl.load(w_rows + ks[:, None] * stride_wk, mask=is_k[:, None] & is_col[None, :],
                    other=0.0).to(COMPUTE_DTYPE)  # fmt: skip
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(b2_ptr + expert * stride_be + cols, mask=is_col, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + tl.where(is_pair, pairs, 0), mask=is_pair, other=0.0)
    acc = acc * weight.to(tl.float32)[:, None]
    out = out_ptr + tl.where(is_pair, pairs, 0)[:, None].to(tl.int64) * stride_op
    tl.store(out + cols[None, :] * stride_oh, acc, mask=is_pair[:, None] & is_col[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pairs, block experts): row r of the sorted layout holds pair index
    ``token * top_k + choice`` or -1 (padding), each expert's pairs in one run of whole
    ``block_m`` blocks, in expert order; block b's expert, or -1 for a block past them all.
    Sized for the worst case, so the shapes depend only on the pair count and expert count."""
    flat = topk_ids.reshape(-1).clamp(max=num_experts)  # num_experts: held elsewhere
    num_pairs = flat.numel()
    device = flat.device
    # No bincount or boolean indexing: on a GPU both read the device back (a size, a max),
    # which a CUDA graph cannot capture.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    safe = experts.clamp(max=num_experts - 1)
    first_sorted = counts.cumsum(0) - counts  # where each expert's pairs begin in ``order``
    dest = starts[safe] + torch.arange(num_pairs, device=device) - first_sorted[safe]
    max_rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    # Pairs held elsewhere land in one extra row, cut off after.
    dest = torch.where(experts < num_experts, dest, max_rows)
    sorted_pairs = torch.full((max_rows + 1,), -1, dtype=torch.int32, device=device)
    sorted_pairs = sorted_pairs.scatter_(0, dest, order.to(torch.int32))[:max_rows]
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    kind: ExpertKind = GATED_SILU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``kernels.moe.reference.grouped_experts`` computes (same arguments), fused."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size, inter_size = w2.shape
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts)
    inter = torch.empty(
        (sorted_pairs.numel(), inter_size), dtype=hidden.dtype, device=hidden.device
    )
    # fp32 rows, summed per token after; a pair routed elsewhere keeps its zeros.
    pair_out = torch.zeros(
        (num_tokens * top_k, hidden_size), dtype=torch.float32, device=hidden.device
    )
    weights = topk_weights.reshape(-1).contiguous()
    num_blocks = block_expert.numel()
    constexprs = _constexprs(hidden.dtype)
    # A pointer the kernels never read stands in for an absent bias.
    b13_arg, b2_arg = (hidden if b is None else b for b in (b13, b2))
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, BLOCK_N))](
        hidden, w13, b13_arg, inter, sorted_pairs, block_expert,
        inter_size, hidden_size, top_k, kind.alpha, kind.limit,
        hidden.stride(0), hidden.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        0 if b13 is None else b13.stride(0),
        inter.stride(0), inter.stride(1),
        GATED=kind.gated, ACTIVATION=ACTIVATIONS.index(kind.activation),
        HAS_BIAS=b13 is not None,
        **constexprs,
    )  # fmt: skip
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, BLOCK_N))](
        inter, w2, b2_arg, pair_out, sorted_pairs, block_expert, weights,
        hidden_size, inter_size,
        inter.stride(0), inter.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        0 if b2 is None else b2.stride(0),
        pair_out.stride(0), pair_out.stride(1),
        HAS_BIAS=b2 is not None,
        **constexprs,
    )  # fmt: skip
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


def _constexprs(dtype: torch.dtype) -> dict:
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **dot_constexprs(dtype))
