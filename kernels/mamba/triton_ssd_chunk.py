"""Triton SSD prefill, stages 1, 2 and 4: what each chunk computes on its own.

``_chunk_cumsum_kernel`` turns raw dt into ``dt' = max(softplus(dt + dt_bias), dt_min)`` and
the running sum of ``dt' * A`` within each chunk. ``_chunk_state_kernel`` computes each chunk's
final state from a zero start, ``sum_j exp(cs_last - cs_j) dt'_j x_j ⊗ B_j``.
``_chunk_cb_kernel`` computes ``C·Bᵀ`` of every chunk and group, on and below the diagonal
only (the scan never reads above it). All three are varlen over the chunk table of
``kernels.mamba.chunks``; their outputs are float32 scratch buffers, contiguous, with every
chunk padded to ``CHUNK_SIZE`` cells (cells past a chunk's end have dt' = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mamba.chunks import SSDChunks
from kernels.mamba.triton_state_update import softplus_dt

DOT_PRECISION = tl.constexpr("ieee")  # the SSD's math is float32; tf32 would round inputs


@triton.jit
def _chunk_cumsum_kernel(
    dt_out_ptr, cum_ptr, dt_ptr, dt_bias_ptr, A_ptr, chunk_start_ptr, chunk_len_ptr,
    dt_min, num_heads, stride_dtt, stride_dth,
    CHUNK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cells = tl.arange(0, CHUNK_SIZE)
    is_head = heads < num_heads
    is_cell = cells < tl.load(chunk_len_ptr + chunk)
    tokens = tl.load(chunk_start_ptr + chunk).to(tl.int64) + cells
    is_live = is_cell[:, None] & is_head[None, :]
    dt = tl.load(dt_ptr + tokens[:, None] * stride_dtt + heads[None, :] * stride_dth,
                 mask=is_live, other=0.0).to(tl.float32)  # fmt: skip
    dt_bias = tl.load(dt_bias_ptr + heads, mask=is_head, other=0.0).to(tl.float32)
    dt = tl.where(is_live, softplus_dt(dt, dt_bias[None, :], dt_min), 0.0)  # [Q, BLOCK_H]
    A = tl.load(A_ptr + heads, mask=is_head, other=0.0).to(tl.float32)
    cum = tl.cumsum(dt * A[None, :], axis=0)
    # Both outputs are [NC, H, Q].
    offsets = (chunk * num_heads + heads[None, :]).to(tl.int64) * CHUNK_SIZE + cells[:, None]
    tl.store(dt_out_ptr + offsets, dt, mask=is_head[None, :])
    tl.store(cum_ptr + offsets, cum, mask=is_head[None, :])


@triton.jit
def _chunk_state_kernel(
    states_ptr, x_ptr, B_ptr, dt_ptr, cum_ptr, chunk_start_ptr, chunk_len_ptr,
    num_heads, head_dim, state_size, heads_per_group,
    stride_xt, stride_xh, stride_xp, stride_bt, stride_bg, stride_bn,
    CHUNK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    chunk, head = tl.program_id(0), tl.program_id(1)
    num_n_blocks = tl.cdiv(state_size, BLOCK_N)
    rows = (tl.program_id(2) // num_n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)  # p
    cols = (tl.program_id(2) % num_n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # n
    is_row, is_col = rows < head_dim, cols < state_size
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    x_ptr += head * stride_xh + rows[:, None] * stride_xp
    B_ptr += (head // heads_per_group) * stride_bg + cols[None, :] * stride_bn
    head_cells = (chunk * num_heads + head).to(tl.int64) * CHUNK_SIZE
    cum_last = tl.load(cum_ptr + head_cells + CHUNK_SIZE - 1)

    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for k_start in range(0, length, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        is_k = ks < length
        is_x = is_row[:, None] & is_k[None, :]
        x = tl.load(x_ptr + (start + ks)[None, :] * stride_xt, mask=is_x, other=0.0)
        x = x.to(tl.float32)  # [BLOCK_P, BLOCK_K]
        cum = tl.load(cum_ptr + head_cells + ks, mask=is_k, other=0.0)
        dt = tl.load(dt_ptr + head_cells + ks, mask=is_k, other=0.0)
        is_b = is_k[:, None] & is_col[None, :]
        b = tl.load(B_ptr + (start + ks)[:, None] * stride_bt, mask=is_b, other=0.0)
        b = b.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        weighted = x * (tl.exp(cum_last - cum) * dt)[None, :]
        acc += tl.dot(weighted, b, input_precision=DOT_PRECISION)
    # states is [NC, H, P, N].
    cells = ((chunk * num_heads + head).to(tl.int64) * head_dim + rows[:, None]) * state_size
    tl.store(states_ptr + cells + cols[None, :], acc, mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _chunk_cb_kernel(
    cb_ptr, B_ptr, C_ptr, chunk_start_ptr, chunk_len_ptr, num_groups, state_size,
    stride_bt, stride_bg, stride_bn, stride_ct, stride_cg, stride_cn,
    CHUNK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    chunk, group = tl.program_id(0), tl.program_id(1)
    num_blocks = tl.cdiv(CHUNK_SIZE, BLOCK_M)
    row_block, col_block = tl.program_id(2) // num_blocks, tl.program_id(2) % num_blocks
    if col_block > row_block:  # above the diagonal: never read
        return
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # i, the C side
    cols = col_block * BLOCK_M + tl.arange(0, BLOCK_M)  # j, the B side
    is_row, is_col = rows < length, cols < length
    C_ptr += (start + rows)[:, None] * stride_ct + group * stride_cg
    B_ptr += (start + cols)[None, :] * stride_bt + group * stride_bg

    acc = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    for k_start in range(0, state_size, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        is_k = ks < state_size
        c = tl.load(C_ptr + ks[None, :] * stride_cn, mask=is_row[:, None] & is_k[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        b = tl.load(B_ptr + ks[:, None] * stride_bn, mask=is_k[:, None] & is_col[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.dot(c, b, input_precision=DOT_PRECISION)
    # cb is [NC, G, Q, Q].
    cells = ((chunk * num_groups + group).to(tl.int64) * CHUNK_SIZE + rows[:, None]) * CHUNK_SIZE
    is_cell = (rows < CHUNK_SIZE)[:, None] & (cols < CHUNK_SIZE)[None, :]
    tl.store(cb_ptr + cells + cols[None, :], acc, mask=is_cell)


def chunk_cumsum(
    dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, chunks: SSDChunks, dt_min: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt' ``[NC, H, Q]``, cumulative dA ``[NC, H, Q]``), float32."""
    num_heads, size = dt.shape[1], chunks.chunk_size
    shape = (chunks.num_chunks_total, num_heads, size)
    dt_out = dt.new_empty(shape, dtype=torch.float32)
    cum = torch.empty_like(dt_out)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // size))
    _chunk_cumsum_kernel[(shape[0], triton.cdiv(num_heads, block_h))](
        dt_out, cum, dt, dt_bias, A, chunks.chunk_start, chunks.chunk_len, dt_min, num_heads,
        *dt.stride(), CHUNK_SIZE=size, BLOCK_H=block_h,
    )  # fmt: skip
    return dt_out, cum


def chunk_states(
    x: torch.Tensor, B: torch.Tensor, dt: torch.Tensor, cum: torch.Tensor, chunks: SSDChunks
) -> torch.Tensor:
    """Each chunk's final state from a zero start, ``[NC, H, P, N]`` float32."""
    _, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    states = x.new_empty((chunks.num_chunks_total, num_heads, head_dim, state_size),
                         dtype=torch.float32)  # fmt: skip
    block_p, block_n = dot_block(head_dim, 64), dot_block(state_size, 64)
    tiles = triton.cdiv(head_dim, block_p) * triton.cdiv(state_size, block_n)
    _chunk_state_kernel[(states.shape[0], num_heads, tiles)](
        states, x, B, dt, cum, chunks.chunk_start, chunks.chunk_len, num_heads, head_dim,
        state_size, num_heads // num_groups, *x.stride(), *B.stride(),
        CHUNK_SIZE=chunks.chunk_size, BLOCK_P=block_p, BLOCK_N=block_n,
        BLOCK_K=dot_block(chunks.chunk_size, 32),
    )  # fmt: skip
    return states


def chunk_cb(C: torch.Tensor, B: torch.Tensor, chunks: SSDChunks) -> torch.Tensor:
    """``C_i · B_j`` of every chunk and group, ``[NC, G, Q, Q]`` float32; only j <= i is set."""
    num_groups, state_size = B.shape[1:]
    size = chunks.chunk_size
    cb = B.new_empty((chunks.num_chunks_total, num_groups, size, size), dtype=torch.float32)
    block_m = dot_block(size, 64)
    _chunk_cb_kernel[(cb.shape[0], num_groups, triton.cdiv(size, block_m) ** 2)](
        cb, B, C, chunks.chunk_start, chunks.chunk_len, num_groups, state_size,
        *B.stride(), *C.stride(),
        CHUNK_SIZE=size, BLOCK_M=block_m, BLOCK_K=dot_block(state_size, 64),
    )  # fmt: skip
    return cb


def dot_block(size: int, largest: int) -> int:
    """A tile edge for ``size``: a power of two, at least 16 (``tl.dot`` on GPUs), at most
    ``largest`` unless 16 is already more."""
    return max(16, min(largest, triton.next_power_of_2(size)))
