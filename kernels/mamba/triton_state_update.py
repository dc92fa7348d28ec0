"""Triton selective state update: the Mamba-2 decode step, one token per request.

A program owns one request, one head and ``BLOCK_P`` rows of its ``[P, N]`` state: it loads
the rows from the request's slot (through the strides) as float32, decays them by
``exp(dt' * A)``, adds ``dt' * x ⊗ B``, writes them back in the state's dtype and reduces them
against C for the output, plus ``D * x``. No autotuning: a trial launch would update the state.
The torch reference is ``kernels.mamba.ssd_reference.ssd_decode_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mamba.base import SSDParams
from kernels.mamba.ssd_reference import check_ssd_shapes


@triton.jit
def softplus_dt(dt, dt_bias, dt_min):
    # dt' = max(softplus(dt + dt_bias), dt_min); softplus is the identity past 20, as in torch.
    dt = dt + dt_bias
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    return tl.maximum(dt, dt_min)


@triton.jit
def _state_update_kernel(
    out_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr,
    state_indices_ptr, dt_min, head_dim, state_size, heads_per_group,
    stride_xr, stride_xh, stride_xp, stride_or, stride_oh, stride_op,
    stride_dtr, stride_dth, stride_br, stride_bg, stride_bn, stride_cr, stride_cg, stride_cn,
    stride_ss, stride_sh, stride_sp, stride_sn,
    BLOCK_P: tl.constexpr, STATE_PAD: tl.constexpr,
):  # fmt: skip
    req, head = tl.program_id(0), tl.program_id(1)
    group = head // heads_per_group
    rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, STATE_PAD)
    is_row, is_col = rows < head_dim, cols < state_size
    is_cell = is_row[:, None] & is_col[None, :]

    state_ptr += tl.load(state_indices_ptr + req).to(tl.int64) * stride_ss + head * stride_sh
    s_ptrs = state_ptr + rows[:, None] * stride_sp + cols[None, :] * stride_sn
    state = tl.load(s_ptrs, mask=is_cell, other=0.0).to(tl.float32)  # [BLOCK_P, STATE_PAD]
    x = tl.load(x_ptr + req * stride_xr + head * stride_xh + rows * stride_xp, mask=is_row,
                other=0.0).to(tl.float32)  # fmt: skip
    dt = tl.load(dt_ptr + req * stride_dtr + head * stride_dth).to(tl.float32)
    dt = softplus_dt(dt, tl.load(dt_bias_ptr + head).to(tl.float32), dt_min)
    decay = tl.exp(dt * tl.load(A_ptr + head).to(tl.float32))
    b = tl.load(B_ptr + req * stride_br + group * stride_bg + cols * stride_bn, mask=is_col,
                other=0.0).to(tl.float32)  # fmt: skip
    c = tl.load(C_ptr + req * stride_cr + group * stride_cg + cols * stride_cn, mask=is_col,
                other=0.0).to(tl.float32)  # fmt: skip

    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=is_cell)
    y = tl.sum(state * c[None, :], axis=1) + tl.load(D_ptr + head).to(tl.float32) * x
    o_ptrs = out_ptr + req * stride_or + head * stride_oh + rows * stride_op
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=is_row)


def ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSDParams,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MambaBackend.ssd_decode`` (see ``kernels.mamba.base``), into ``out`` if given."""
    check_ssd_shapes(x, dt, B, C, ssm_state)
    num_reqs, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    out = torch.empty_like(x) if out is None else out
    if num_reqs == 0:
        return out
    state_pad = triton.next_power_of_2(state_size)
    # About 4K state cells per program, as the state's rows are read and written once.
    block_p = max(1, min(triton.next_power_of_2(head_dim), 4096 // state_pad))
    grid = (num_reqs, num_heads, triton.cdiv(head_dim, block_p))
    _state_update_kernel[grid](
        out, x, dt, params.A, B, C, params.D, params.dt_bias, ssm_state, state_indices,
        params.dt_min, head_dim, state_size,
        num_heads // num_groups, *x.stride(), *out.stride(), *dt.stride(), *B.stride(),
        *C.stride(), *ssm_state.stride(), BLOCK_P=block_p, STATE_PAD=state_pad,
    )  # fmt: skip
    return out
