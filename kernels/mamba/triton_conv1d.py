"""Triton causal depthwise conv1d (+ SiLU) for Mamba-2: varlen prefill and one-token decode.

Prefill is two kernels. ``_conv1d_prefill_kernel`` computes the outputs: a program owns
``BLOCK_T`` tokens of one request and ``BLOCK_D`` channels, and each of the K taps reads either
a new token or, before the request's first token, a row of its initial state. Then
``_conv1d_state_kernel`` writes windows of K-1 inputs into slots: first the checkpoints, then,
in a second launch, each request's final window into its own slot. The split keeps every
read of an initial state ahead of the write that replaces it. Decode
(``_conv1d_decode_kernel``) reads a slot's window and the new token, and writes the window
shifted by one back in place. States are read and written through their strides. The torch
reference is ``kernels.mamba.conv1d_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mamba.base import ConvWeights, VarlenBatch
from kernels.mamba.conv1d_reference import check_conv_shapes

BLOCK_T, BLOCK_D = 16, 64


@triton.jit
def _request_of_tile(query_start_loc_ptr, num_reqs, tile, BLOCK_T: tl.constexpr):
    # Request i owns tiles from query_start_loc[i] // BLOCK_T + i on; find the last request
    # whose first tile is <= tile.
    lo = tl.full([], 0, tl.int32)  # tensors, not constants: the loop carries them
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        is_before = tl.load(query_start_loc_ptr + mid) // BLOCK_T + mid <= tile
        lo = tl.where(is_before, mid + 1, lo)
        hi = tl.where(is_before, hi, mid)
    return lo - 1


@triton.jit
def _window_input(x_ptr, state_ptr, req_start, src, has_initial, dims, is_live,
                  stride_xt, stride_xd, stride_sk, stride_sd, HISTORY: tl.constexpr):  # fmt: skip
    # [rows, BLOCK_D] inputs at request-local positions ``src``: a new token where src >= 0,
    # else row HISTORY + src of the initial state (zeros where has_initial is 0). fp32.
    is_new = src >= 0
    x_ptrs = x_ptr + (req_start + src).to(tl.int64)[:, None] * stride_xt + dims[None, :] * stride_xd
    new = tl.load(x_ptrs, mask=is_live & is_new[:, None], other=0.0).to(tl.float32)
    s_ptrs = state_ptr + (HISTORY + src)[:, None] * stride_sk + dims[None, :] * stride_sd
    # (The interpreter refuses masks that combine a tensor with a scalar bool.)
    is_old = is_live & ((~is_new).to(tl.int32) * has_initial != 0)[:, None]
    return new + tl.load(s_ptrs, mask=is_old, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["num_reqs"])  # one variant for every batch size
def _conv1d_prefill_kernel(
    out_ptr, x_ptr, weight_ptr, bias_ptr, state_ptr, state_indices_ptr, has_initial_ptr,
    query_start_loc_ptr, num_reqs, dim,
    stride_xt, stride_xd, stride_ot, stride_od, stride_wd, stride_wk,
    stride_ss, stride_sk, stride_sd,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    req = _request_of_tile(query_start_loc_ptr, num_reqs, tile, BLOCK_T)
    req_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - req_start
    tile_start = (tile - (req_start // BLOCK_T + req)) * BLOCK_T
    if tile_start >= query_len:  # a spare program of the over-sized grid
        return
    tokens = tile_start + tl.arange(0, BLOCK_T)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    is_dim = dims < dim
    is_live = (tokens < query_len)[:, None] & is_dim[None, :]
    has_initial = tl.load(has_initial_ptr + req).to(tl.int32)
    state_ptr += tl.load(state_indices_ptr + req).to(tl.int64) * stride_ss

    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + dims, mask=is_dim, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        inputs = _window_input(
            x_ptr, state_ptr, req_start, tokens - (WIDTH - 1) + k, has_initial, dims, is_live,
            stride_xt, stride_xd, stride_sk, stride_sd, WIDTH - 1,
        )  # fmt: skip
        tap = tl.load(weight_ptr + dims * stride_wd + k * stride_wk, mask=is_dim, other=0.0)
        acc += inputs * tap.to(tl.float32)[None, :]
    out = acc * tl.sigmoid(acc)
    o_ptrs = out_ptr + (req_start + tokens).to(tl.int64)[:, None] * stride_ot
    tl.store(o_ptrs + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=is_live)


@triton.jit
def _conv1d_state_kernel(
    rows_ptr, x_ptr, state_ptr, state_indices_ptr, has_initial_ptr, query_start_loc_ptr, dim,
    stride_xt, stride_xd, stride_ss, stride_sk, stride_sd,
    HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Row (request r, tokens consumed n, slot s): slot s gets r's inputs n-HISTORY .. n-1.
    row = rows_ptr + tl.program_id(0) * 3
    req, consumed, slot = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    window = tl.arange(0, HISTORY_PAD)
    is_live = (window < HISTORY)[:, None] & (dims < dim)[None, :]
    has_initial = tl.load(has_initial_ptr + req).to(tl.int32)
    initial_ptr = state_ptr + tl.load(state_indices_ptr + req).to(tl.int64) * stride_ss
    inputs = _window_input(
        x_ptr, initial_ptr, tl.load(query_start_loc_ptr + req), consumed - HISTORY + window,
        has_initial, dims, is_live, stride_xt, stride_xd, stride_sk, stride_sd, HISTORY,
    )  # fmt: skip
    tl.debug_barrier()  # every read of the slot before any write to it (s may be r's own slot)
    s_ptrs = state_ptr + slot.to(tl.int64) * stride_ss + window[:, None] * stride_sk
    tl.store(s_ptrs + dims[None, :] * stride_sd, inputs.to(state_ptr.dtype.element_ty),
             mask=is_live)  # fmt: skip


@triton.jit
def _conv1d_decode_kernel(
    out_ptr, x_ptr, weight_ptr, bias_ptr, state_ptr, state_indices_ptr, dim,
    stride_xr, stride_xd, stride_or, stride_od, stride_wd, stride_wk,
    stride_ss, stride_sk, stride_sd,
    HISTORY: tl.constexpr, HISTORY_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    is_dim = dims < dim
    window = tl.arange(0, HISTORY_PAD)
    is_old = window < HISTORY
    state_ptr += tl.load(state_indices_ptr + req).to(tl.int64) * stride_ss
    s_ptrs = state_ptr + window[:, None] * stride_sk + dims[None, :] * stride_sd
    old = tl.load(s_ptrs, mask=is_old[:, None] & is_dim[None, :], other=0.0).to(tl.float32)
    new = tl.load(x_ptr + req * stride_xr + dims * stride_xd, mask=is_dim, other=0.0)
    new = new.to(tl.float32)

    w_ptrs = weight_ptr + dims[None, :] * stride_wd + window[:, None] * stride_wk
    taps = tl.load(w_ptrs, mask=is_old[:, None] & is_dim[None, :], other=0.0).to(tl.float32)
    last_tap = tl.load(weight_ptr + dims * stride_wd + HISTORY * stride_wk, mask=is_dim, other=0.0)
    acc = tl.sum(old * taps, axis=0) + new * last_tap.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + dims, mask=is_dim, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + req * stride_or + dims * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=is_dim)  # fmt: skip

    # The window moves by one: row j takes row j + 1, the last row the new token.
    is_shifted = (window + 1 < HISTORY)[:, None] & is_dim[None, :]
    shifted = tl.load(s_ptrs + stride_sk, mask=is_shifted, other=0.0).to(tl.float32)
    shifted = tl.where((window + 1 == HISTORY)[:, None], new[None, :], shifted)
    tl.debug_barrier()  # every read of the slot before any write to it
    tl.store(s_ptrs, shifted.to(state_ptr.dtype.element_ty),
             mask=is_old[:, None] & is_dim[None, :])  # fmt: skip


def conv1d_prefill(
    x: torch.Tensor,
    conv: ConvWeights,
    conv_state: torch.Tensor,
    batch: VarlenBatch,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MambaBackend.conv1d_prefill`` (see ``kernels.mamba.base``), into ``out`` if given."""
    weight, bias, state_indices = conv.weight, conv.bias, batch.state_indices
    has_initial_state, query_start_loc = batch.has_initial_state, batch.query_start_loc
    width = check_conv_shapes(x, weight, conv_state)
    _check_last_dim_contiguous(conv_state)
    num_tokens, dim = x.shape
    num_reqs = state_indices.shape[0]
    out = torch.empty_like(x) if out is None else out
    if num_reqs == 0:
        return out
    num_d_blocks = triton.cdiv(dim, BLOCK_D)
    _conv1d_prefill_kernel[(num_tokens // BLOCK_T + num_reqs, num_d_blocks)](
        out, x, weight, bias if bias is not None else weight, conv_state, state_indices,
        has_initial_state, query_start_loc, num_reqs, dim,
        *x.stride(), *out.stride(), *weight.stride(), *conv_state.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    requests = torch.arange(num_reqs, device=x.device, dtype=torch.int32)
    finals = torch.stack([requests, query_lens.to(torch.int32), state_indices.to(torch.int32)], 1)
    for rows in (batch.checkpoints, finals):  # checkpoints first: they may read r's initial state
        if rows is None or rows.shape[0] == 0:
            continue
        _conv1d_state_kernel[(rows.shape[0], num_d_blocks)](
            rows.to(torch.int32).contiguous(), x, conv_state, state_indices, has_initial_state,
            query_start_loc, dim, *x.stride(), *conv_state.stride(),
            HISTORY=width - 1, HISTORY_PAD=triton.next_power_of_2(width - 1), BLOCK_D=BLOCK_D,
        )  # fmt: skip
    return out


def conv1d_decode(
    x: torch.Tensor,
    conv: ConvWeights,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MambaBackend.conv1d_decode`` (see ``kernels.mamba.base``), into ``out`` if given."""
    weight, bias = conv.weight, conv.bias
    width = check_conv_shapes(x, weight, conv_state)
    _check_last_dim_contiguous(conv_state)
    num_reqs, dim = x.shape
    out = torch.empty_like(x) if out is None else out
    if num_reqs == 0:
        return out
    _conv1d_decode_kernel[(num_reqs, triton.cdiv(dim, BLOCK_D))](
        out, x, weight, bias if bias is not None else weight, conv_state, state_indices, dim,
        *x.stride(), *out.stride(), *weight.stride(), *conv_state.stride(),
        HISTORY=width - 1, HISTORY_PAD=triton.next_power_of_2(width - 1),
        HAS_BIAS=bias is not None, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return out


def _check_last_dim_contiguous(state: torch.Tensor) -> None:
    if state.stride(-1) != 1:
        raise ValueError(f"The state's last dim must be contiguous, got strides {state.stride()}.")
