"""Triton unified paged attention: prefill chunks and decode tokens in one launch.

Each program owns one tile of ``BLOCK_Q`` query tokens of one request and one KV head, and
stacks the tile's ``QUERIES_PER_KV`` query heads of that KV head into the rows of a
``[BLOCK_Q * QPK_PAD, HEAD_PAD]`` block, so GQA/MQA share every K/V load. It streams the
request's keys in tiles of ``TILE_N`` positions with an online (flash) softmax in fp32.

Position p of a request is found through its block table and then through the view's strides:
slot ``block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE``, kernel block
``slot // KERNEL_BLOCK_SIZE``, row ``slot % KERNEL_BLOCK_SIZE``. That is the whole of the
layout handling: all six layouts and kernel-block split views take the same path. The torch
reference is ``kernels.attention.reference.paged_attention_reference``; the benchmark is
``kernels/attention/bench.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.cache_view import check_kv_cache, check_query_heads
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.triton_support import TL_DTYPES, dot_constexprs

LOG2E = tl.constexpr(1.4426950408889634)  # jitted code may only read constexpr globals
# Rows per program: a small tile keeps decode-heavy batches from idling, a large one gives
# prefill enough rows per K/V load. tl.dot needs at least 16 on GPUs.
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    # Request i owns tiles from query_start_loc[i] // BLOCK_Q + i on; binary-search the last
    # request whose first tile is <= tile.
    lo = tl.full([], 0, tl.int32)  # tensors, not constants: the loop carries them
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        is_before = first_tile <= tile
        lo = tl.where(is_before, mid + 1, lo)
        hi = tl.where(is_before, hi, mid)
    return lo - 1


@triton.jit
def _row_pointers(base_ptr, token, head, dims, stride_t, stride_h, stride_d):
    # [BLOCK_M, dims] pointers into a [T, H, D] tensor for (token, head) rows.
    rows = token.to(tl.int64)[:, None] * stride_t + head[:, None] * stride_h
    return base_ptr + rows + dims[None, :] * stride_d


@triton.jit
def _cell_pointers(head_base, block_row_ptr, key_pos, is_key, stride_cb, stride_cn,
                   BLOCK_SIZE: tl.constexpr, KERNEL_BLOCK_SIZE: tl.constexpr):  # fmt: skip
    # Position -> manager block (block table) -> slot -> kernel block and row (view strides).
    block = tl.load(block_row_ptr + key_pos // BLOCK_SIZE, mask=is_key, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE
    kernel_block = slot // KERNEL_BLOCK_SIZE
    return head_base + kernel_block * stride_cb + (slot % KERNEL_BLOCK_SIZE) * stride_cn


# Values that change from step to step are not specialised on: triton would otherwise compile a
# variant for each of 1, a multiple of 16 and any other value (the batch's request count, the
# block table's width) while serving.
@triton.jit(do_not_specialize=["num_reqs", "sliding_window", "stride_bt"])
def _paged_attention_kernel(
    out_ptr, query_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    sinks_ptr, num_reqs, scale, softcap, sliding_window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_ch, stride_cn, stride_cc,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr, HEAD_V_PAD: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, KERNEL_BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
    tile_start = (tile - (query_start // BLOCK_Q + req)) * BLOCK_Q
    if tile_start >= query_len:  # a spare program of the over-sized grid
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    # Rows are (query token, query head of this KV head) pairs: [BLOCK_M] = [BLOCK_Q * QPK_PAD].
    rows = tl.arange(0, BLOCK_Q * QPK_PAD)
    row_token = tile_start + rows // QPK_PAD
    row_head = kv_head * QUERIES_PER_KV + rows % QPK_PAD
    is_row = (row_token < query_len) & (rows % QPK_PAD < QUERIES_PER_KV)
    row_pos = context_len + row_token
    dims = tl.arange(0, HEAD_PAD)
    q_ptrs = _row_pointers(
        query_ptr, query_start + row_token, row_head, dims, stride_qt, stride_qh, stride_qd
    )
    query = tl.load(q_ptrs, mask=is_row[:, None] & (dims < HEAD_SIZE)[None, :], other=0.0)
    # Products run in COMPUTE_DTYPE: the cache dtype on GPUs, fp32 under the interpreter
    # (which multiplies bf16 as raw integers). fp32 products use "ieee", never tf32.
    query = query.to(COMPUTE_DTYPE)

    # Logits are kept in log2 units so the softmax can use exp2.
    if HAS_SINKS:
        row_max = tl.load(sinks_ptr + row_head, mask=is_row, other=0.0).to(tl.float32) * LOG2E
        row_sum = tl.full([BLOCK_Q * QPK_PAD], 1.0, tl.float32)
    else:
        row_max = tl.full([BLOCK_Q * QPK_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_Q * QPK_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * QPK_PAD, HEAD_V_PAD], tl.float32)

    # Keys this tile can see: up to its last query's position, from its first query's window.
    key_end = tl.minimum(seq_len, context_len + tile_start + BLOCK_Q)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = tl.maximum(context_len + tile_start - sliding_window + 1, 0)
        key_begin = (key_begin // TILE_N) * TILE_N
    head_base = cache_ptr + kv_head.to(tl.int64) * stride_ch
    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    # K is the first HEAD_SIZE elements of a cell, V the next HEAD_SIZE_V.
    dims_v = tl.arange(0, HEAD_V_PAD)
    k_offsets = dims[:, None].to(tl.int64) * stride_cc  # [HEAD_PAD, 1]
    v_offsets = (HEAD_SIZE + dims_v[None, :]).to(tl.int64) * stride_cc  # [1, HEAD_V_PAD]
    is_k_dim = (dims < HEAD_SIZE)[:, None]
    is_v_dim = (dims_v < HEAD_SIZE_V)[None, :]
    for key_start in range(key_begin, key_end, TILE_N):
        key_pos = key_start + tl.arange(0, TILE_N)
        is_key = key_pos < key_end
        cells = _cell_pointers(
            head_base, block_row_ptr, key_pos, is_key, stride_cb, stride_cn,
            BLOCK_SIZE, KERNEL_BLOCK_SIZE,
        )  # fmt: skip

        key = tl.load(cells[None, :] + k_offsets, mask=is_key[None, :] & is_k_dim, other=0.0)
        key = key.to(COMPUTE_DTYPE)  # [HEAD_PAD, TILE_N]
        logits = tl.dot(query, key, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), saturating cleanly at +-1.
            logits = softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))
        logits = logits * LOG2E
        # Causality alone bounds every real row to keys < key_end. Rows outside the batch may
        # see masked-out (zero) keys; they stay finite and are never stored.
        is_visible = key_pos[None, :] <= row_pos[:, None]
        if HAS_WINDOW:
            is_visible = is_visible & (key_pos[None, :] > row_pos[:, None] - sliding_window)
        logits = tl.where(is_visible, logits, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        # A row that has seen nothing yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(logits - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)

        value = tl.load(cells[:, None] + v_offsets, mask=is_key[:, None] & is_v_dim, other=0.0)
        value = value.to(COMPUTE_DTYPE)  # [TILE_N, HEAD_V_PAD]
        pv = tl.dot(probs.to(COMPUTE_DTYPE), value, input_precision=DOT_PRECISION)
        acc = acc * rescale[:, None] + pv
        row_max = new_max

    # Rows outside the batch saw no keys (sum 0); give them 1 so they divide quietly.
    out = acc / tl.where(is_row, row_sum, 1.0)[:, None]
    o_ptrs = _row_pointers(
        out_ptr, query_start + row_token, row_head, dims_v, stride_ot, stride_oh, stride_od
    )
    is_out = is_row[:, None] & (dims_v < HEAD_SIZE_V)[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=is_out)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    params: AttentionParams,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query`` ``[T, Hq, D]`` over ``kv_cache`` ``[B, H, N, C]``.

    Returns ``[T, Hq, head_size_v]`` in the query's dtype (written into ``out`` if given).
    Rows past ``metadata.num_actual_tokens`` are left as they were.
    """
    num_tokens, num_q_heads, head_size = query.shape
    head_size_v = params.resolve_head_size_v(head_size)
    check_kv_cache(kv_cache, params.num_kv_heads, head_size, head_size_v)
    check_query_heads(num_q_heads, params.num_kv_heads)
    if kv_cache.dtype not in TL_DTYPES:
        raise ValueError(f"paged_attention reads fp32/bf16/fp16 caches, not {kv_cache.dtype}.")
    expected = (num_tokens, num_q_heads, head_size_v)
    if out is None:
        out = query.new_empty(expected)
    if out.shape != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {expected}.")
    if metadata.num_actual_tokens == 0:
        return out
    constexprs = launch_constexprs(query, kv_cache, metadata, params)
    # Request i owns tiles query_start_loc[i] // BLOCK_Q + i onwards, so this many suffice.
    num_tiles = metadata.num_actual_tokens // constexprs["BLOCK_Q"] + metadata.num_reqs
    sinks = params.sinks if params.sinks is not None else query  # unread when HAS_SINKS is off
    _paged_attention_kernel[(num_tiles, params.num_kv_heads)](
        out, query, kv_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
        sinks, metadata.num_reqs, params.scale, params.softcap or 1.0, params.sliding_window or 1,
        *query.stride(), *out.stride(), *kv_cache.stride(), metadata.block_table.stride(0),
        **constexprs,
    )  # fmt: skip
    return out


def launch_constexprs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    params: AttentionParams,
) -> dict[str, object]:
    """The compile-time settings of one launch (also used to compile the kernel ahead of time
    in the tests, so they check exactly what a GPU would run)."""
    num_q_heads, head_size = query.shape[1:]
    head_size_v = params.resolve_head_size_v(head_size)
    queries_per_kv = num_q_heads // params.num_kv_heads
    qpk_pad = triton.next_power_of_2(queries_per_kv)
    is_prefill_heavy = metadata.max_query_len >= PREFILL_BLOCK_M
    block_m = PREFILL_BLOCK_M if is_prefill_heavy else DECODE_BLOCK_M
    return dict(
        QUERIES_PER_KV=queries_per_kv, QPK_PAD=qpk_pad, BLOCK_Q=max(1, block_m // qpk_pad),
        HEAD_SIZE=head_size, HEAD_SIZE_V=head_size_v,
        HEAD_PAD=_dot_size(head_size), HEAD_V_PAD=_dot_size(head_size_v),
        TILE_N=64 if is_prefill_heavy else 32,  # key positions per step, any block size
        BLOCK_SIZE=metadata.block_size, KERNEL_BLOCK_SIZE=kv_cache.shape[2],
        HAS_WINDOW=params.sliding_window is not None,
        HAS_SOFTCAP=params.softcap is not None,
        HAS_SINKS=params.sinks is not None,
        **dot_constexprs(kv_cache.dtype),
    )  # fmt: skip


def _dot_size(size: int) -> int:
    # tl.dot needs every dimension to be a power of two and at least 16 on GPUs.
    return max(16, triton.next_power_of_2(size))
