"""Triton SSD prefill, stages 3 and 5: carrying states across chunks, then the outputs.

``_state_passing_kernel`` walks each request's chunks in order from its initial state (read
from its slot through the strides, or zeros): it overwrites each chunk's own state in the
scratch buffer with the state entering the chunk, steps ``h = exp(cs_last) h + S_chunk``,
copies the state after a chunk to the slots of the checkpoints it ends, and writes the
final state to the request's slot, all in the state's dtype. ``_chunk_scan_kernel`` computes
``y_i = exp(cs_i) C_i · h_in + sum_{j<=i} (C_i·B_j) exp(cs_i - cs_j) dt'_j x_j + D x_i`` for a
tile of a chunk's positions and head dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mamba.chunks import SSDChunks
from kernels.mamba.triton_ssd_chunk import DOT_PRECISION, dot_block


@triton.jit
def _state_passing_kernel(
    states_ptr, cum_ptr, ssm_state_ptr, state_indices_ptr, has_initial_ptr, first_chunk_ptr,
    num_chunks_ptr, checkpoint_offsets_ptr, checkpoint_slots_ptr, num_heads, head_dim, state_size,
    stride_ss, stride_sh, stride_sp, stride_sn,
    CHUNK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    req, head = tl.program_id(0), tl.program_id(1)
    num_n_blocks = tl.cdiv(state_size, BLOCK_N)
    rows = (tl.program_id(2) // num_n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)  # p
    cols = (tl.program_id(2) % num_n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # n
    is_cell = (rows < head_dim)[:, None] & (cols < state_size)[None, :]
    # The same cell of any slot, through the view's strides.
    cell_offsets = head * stride_sh + rows[:, None] * stride_sp + cols[None, :] * stride_sn
    slot_ptrs = ssm_state_ptr + tl.load(state_indices_ptr + req).to(tl.int64) * stride_ss
    slot_ptrs += cell_offsets
    has_initial = tl.load(has_initial_ptr + req).to(tl.int32)
    # (The interpreter refuses masks that combine a tensor with a scalar bool.)
    is_initial = is_cell & (rows[:, None] * 0 + has_initial != 0)
    state = tl.load(slot_ptrs, mask=is_initial, other=0.0).to(tl.float32)

    first_chunk = tl.load(first_chunk_ptr + req)
    for k in range(0, tl.load(num_chunks_ptr + req)):
        chunk = first_chunk + k
        head_row = chunk.to(tl.int64) * num_heads + head
        buffer_ptrs = states_ptr + (head_row * head_dim + rows[:, None]) * state_size
        buffer_ptrs += cols[None, :]
        chunk_state = tl.load(buffer_ptrs, mask=is_cell, other=0.0)
        tl.store(buffer_ptrs, state, mask=is_cell)  # now the state entering the chunk
        state = tl.exp(tl.load(cum_ptr + head_row * CHUNK_SIZE + CHUNK_SIZE - 1)) * state
        state += chunk_state
        checkpoints_end = tl.load(checkpoint_offsets_ptr + chunk + 1)
        for i in range(tl.load(checkpoint_offsets_ptr + chunk), checkpoints_end):
            slot = tl.load(checkpoint_slots_ptr + i).to(tl.int64)
            tl.store(ssm_state_ptr + slot * stride_ss + cell_offsets,
                     state.to(ssm_state_ptr.dtype.element_ty), mask=is_cell)  # fmt: skip
    tl.store(slot_ptrs, state.to(ssm_state_ptr.dtype.element_ty), mask=is_cell)


@triton.jit
def _chunk_scan_kernel(
    out_ptr, x_ptr, C_ptr, D_ptr, cb_ptr, cum_ptr, dt_ptr, states_ptr, chunk_start_ptr,
    chunk_len_ptr, num_heads, head_dim, num_groups, state_size,
    stride_xt, stride_xh, stride_xp, stride_ot, stride_oh, stride_op,
    stride_ct, stride_cg, stride_cn,
    CHUNK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    chunk, head = tl.program_id(0), tl.program_id(1)
    num_p_blocks = tl.cdiv(head_dim, BLOCK_P)
    row_start = (tl.program_id(2) // num_p_blocks) * BLOCK_M
    length = tl.load(chunk_len_ptr + chunk)
    if row_start >= length:
        return
    group = head // (num_heads // num_groups)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)  # i: positions in the chunk
    dims = (tl.program_id(2) % num_p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)  # p
    is_row, is_dim = rows < length, dims < head_dim
    head_row = chunk.to(tl.int64) * num_heads + head
    cum_rows = tl.load(cum_ptr + head_row * CHUNK_SIZE + rows, mask=is_row, other=0.0)
    C_ptr += (start + rows)[:, None] * stride_ct + group * stride_cg
    x_ptr += head * stride_xh + dims[None, :] * stride_xp

    # From the state entering the chunk ([P, N] at states[chunk, head]).
    acc = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    state_ptr = states_ptr + (head_row * head_dim + dims[None, :]) * state_size
    for n_start in range(0, state_size, BLOCK_N):
        ns = n_start + tl.arange(0, BLOCK_N)
        is_n = ns < state_size
        c = tl.load(
            C_ptr + ns[None, :] * stride_cn, mask=is_row[:, None] & is_n[None, :], other=0.0
        )
        c = c.to(tl.float32)  # [BLOCK_M, BLOCK_N]
        state = tl.load(state_ptr + ns[:, None], mask=is_n[:, None] & is_dim[None, :], other=0.0)
        acc += tl.dot(c, state, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_P]
    acc *= tl.exp(cum_rows)[:, None]

    # Within the chunk, from positions j <= i.
    cb_ptr += ((chunk.to(tl.int64) * num_groups + group) * CHUNK_SIZE + rows[:, None]) * CHUNK_SIZE
    for col_start in range(0, tl.minimum(length, row_start + BLOCK_M), BLOCK_K):
        cols = col_start + tl.arange(0, BLOCK_K)
        is_col = cols < length
        is_causal = (cols[None, :] <= rows[:, None]) & is_row[:, None] & is_col[None, :]
        cb = tl.load(cb_ptr + cols[None, :], mask=is_causal, other=0.0)  # [BLOCK_M, BLOCK_K]
        cum_cols = tl.load(cum_ptr + head_row * CHUNK_SIZE + cols, mask=is_col, other=0.0)
        dt_cols = tl.load(dt_ptr + head_row * CHUNK_SIZE + cols, mask=is_col, other=0.0)
        gap = tl.where(is_causal, cum_rows[:, None] - cum_cols[None, :], float("-inf"))
        weight = cb * tl.exp(gap) * dt_cols[None, :]
        x = tl.load(x_ptr + (start + cols)[:, None] * stride_xt,
                    mask=is_col[:, None] & is_dim[None, :], other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.dot(weight, x, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_P]

    is_out = is_row[:, None] & is_dim[None, :]
    x_rows = tl.load(x_ptr + (start + rows)[:, None] * stride_xt, mask=is_out, other=0.0)
    acc += tl.load(D_ptr + head).to(tl.float32) * x_rows.to(tl.float32)
    o_ptrs = out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh
    tl.store(o_ptrs + dims[None, :] * stride_op, acc.to(out_ptr.dtype.element_ty), mask=is_out)


def pass_states(
    states: torch.Tensor,
    cum: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunks: SSDChunks,
) -> None:
    """Turns ``states`` (each chunk's own, ``[NC, H, P, N]``) into the states entering each
    chunk, and writes the final states and checkpoints into ``ssm_state``."""
    num_heads, head_dim, state_size = ssm_state.shape[1:]
    num_reqs = state_indices.shape[0]
    block_p, block_n = dot_block(head_dim, 64), dot_block(state_size, 64)
    tiles = triton.cdiv(head_dim, block_p) * triton.cdiv(state_size, block_n)
    checkpoint_offsets, checkpoint_slots = chunks.checkpoints_by_chunk()
    _state_passing_kernel[(num_reqs, num_heads, tiles)](
        states, cum, ssm_state, state_indices, has_initial_state, chunks.first_chunk,
        chunks.num_chunks, checkpoint_offsets, checkpoint_slots, num_heads, head_dim, state_size,
        *ssm_state.stride(), CHUNK_SIZE=chunks.chunk_size, BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip


def chunk_scan(
    out: torch.Tensor,
    x: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cb: torch.Tensor,
    cum: torch.Tensor,
    dt: torch.Tensor,
    states_in: torch.Tensor,
    chunks: SSDChunks,
) -> None:
    """Writes every token's y ``[T, H, P]`` into ``out``."""
    _, num_heads, head_dim = x.shape
    num_groups, state_size = C.shape[1:]
    size = chunks.chunk_size
    block_m, block_p = dot_block(size, 64), dot_block(head_dim, 64)
    tiles = triton.cdiv(size, block_m) * triton.cdiv(head_dim, block_p)
    _chunk_scan_kernel[(chunks.num_chunks_total, num_heads, tiles)](
        out, x, C, D, cb, cum, dt, states_in, chunks.chunk_start, chunks.chunk_len, num_heads,
        head_dim, num_groups, state_size, *x.stride(), *out.stride(), *C.stride(),
        CHUNK_SIZE=size, BLOCK_M=block_m, BLOCK_P=block_p,
        BLOCK_N=dot_block(state_size, 64), BLOCK_K=dot_block(size, 32),
    )  # fmt: skip
