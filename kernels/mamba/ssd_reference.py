"""Torch reference of the Mamba-2 SSD scan: the torch backend's compute (the CPU serving path)
and what the Triton kernels are checked against.

Prefill runs the chunked algorithm in float32, vectorised over all chunks of the batch: within a
chunk the output is a masked ``C·Bᵀ`` product weighted by the decay between positions; across
chunks only one ``[H, P, N]`` state per request is carried, in a loop over chunk index (not over
tokens). Decode is the recurrence for one token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mamba.base import SSDParams, VarlenBatch
from kernels.mamba.chunks import SSDChunks


def ssd_prefill_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSDParams,
    ssm_state: torch.Tensor,
    batch: VarlenBatch,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MambaBackend.ssd_prefill``: y ``[T, H, P]`` (into ``out`` if given); final states and
    checkpoints written."""
    num_heads, num_groups = x.shape[1], B.shape[1]
    check_ssd_shapes(x, dt, B, C, ssm_state)
    chunks = batch.ssd_chunks()
    chunk_size = chunks.chunk_size
    A, D = params.A, params.D
    state_indices = batch.state_indices
    num_chunks, heads = chunks.num_chunks_total, num_heads // num_groups
    # Each chunk as chunk_size cells; cells past the chunk's end get dt' = 0, so they neither
    # decay nor feed the state, and their outputs are dropped.
    cell = torch.arange(chunk_size, device=x.device)
    is_token = cell < chunks.chunk_len[:, None]  # [NC, Q]
    token = torch.where(is_token, chunks.chunk_start[:, None].long() + cell, 0).flatten()

    def by_chunk(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [NC, Q, ...] -> [NC, ..., Q]
        cells = t.float().index_select(0, token).unflatten(0, (num_chunks, chunk_size))
        return cells.movedim(1, -1)

    dt_step = by_chunk(softplus_dt(dt, params.dt_bias, params.dt_min)) * is_token[:, None]
    x_cells = by_chunk(x).transpose(-1, -2)  # [NC, H, Q, P]
    b_cells = by_chunk(B).transpose(-1, -2)[:, :, None]  # [NC, G, 1, Q, N]: shared by a group
    c_cells = by_chunk(C).transpose(-1, -2)[:, :, None]
    log_decay = torch.cumsum(dt_step * A.float()[:, None], dim=-1)  # [NC, H, Q]: sum of dA
    grouped = (num_chunks, num_groups, heads)  # head h reads group h // (H/G)

    y, chunk_states = _within_chunks(x_cells, dt_step, log_decay, b_cells, c_cells, grouped)
    initial = _initial_states(ssm_state, state_indices, batch.has_initial_state)  # [R, H, P, N]
    states_in, states_out, final = _pass_states(chunks, chunk_states, log_decay[..., -1], initial)

    # From the state entering the chunk: y_i += exp(cs_i) C_i · h_in.
    carried = c_cells @ states_in.view(*grouped, *states_in.shape[2:]).transpose(-1, -2)
    y = (y + carried * log_decay.view(*grouped, chunk_size, 1).exp()).flatten(1, 2)
    y = y + D.float()[:, None, None] * x_cells  # [NC, H, Q, P]

    out = torch.empty_like(x) if out is None else out
    y = y.transpose(1, 2).flatten(0, 1)  # [NC, H, Q, P] -> [NC * Q, H, P]
    is_token = is_token.flatten()
    out[token[is_token]] = y[is_token].to(x.dtype)
    if chunks.checkpoint_chunk.numel():
        ssm_state[chunks.checkpoint_slot] = states_out[chunks.checkpoint_chunk].to(ssm_state.dtype)
    ssm_state[state_indices.long()] = final.to(ssm_state.dtype)
    return out


def ssd_decode_reference(
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
    """``MambaBackend.ssd_decode``: one token per request, the state updated in its slot."""
    num_heads, num_groups = x.shape[1], B.shape[1]
    check_ssd_shapes(x, dt, B, C, ssm_state)
    slots = state_indices.long()
    state = ssm_state[slots].float()  # [R, H, P, N]
    dt_step = softplus_dt(dt, params.dt_bias, params.dt_min)  # [R, H]
    group = torch.arange(num_heads, device=x.device) // (num_heads // num_groups)
    b, c = B.float()[:, group], C.float()[:, group]  # [R, G, N] -> [R, H, N]
    inflow = (dt_step[..., None] * x.float())[..., None] * b[:, :, None]  # [R, H, P, N]
    state = torch.exp(dt_step * params.A.float())[..., None, None] * state + inflow
    y = torch.einsum("rhpn,rhn->rhp", state, c) + params.D.float()[:, None] * x.float()
    ssm_state[slots] = state.to(ssm_state.dtype)
    out = torch.empty_like(x) if out is None else out
    out.copy_(y)
    return out


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float) -> torch.Tensor:
    """``dt' = max(softplus(dt + dt_bias), dt_min)`` in float32, ``[T, H]``."""
    return F.softplus(dt.float() + dt_bias.float()).clamp_min(dt_min)


def _within_chunks(x_cells, dt_step, log_decay, b_cells, c_cells, grouped):
    """What each chunk computes from its own tokens: y ``[NC, G, H/G, Q, P]`` from positions
    j <= i of the chunk, and the chunk's final state from a zero start ``[NC, H, P, N]``."""
    chunk_size = dt_step.shape[-1]
    # y_i = sum_{j<=i} (C_i·B_j) exp(cs_i - cs_j) dt_j x_j.
    cb = c_cells @ b_cells.transpose(-1, -2)  # [NC, G, 1, Qi, Qj]
    gap = log_decay[..., :, None] - log_decay[..., None, :]  # [NC, H, Qi, Qj]
    is_causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=gap.device).tril()
    decay = torch.exp(gap.masked_fill(~is_causal, float("-inf"))).view(*grouped, *gap.shape[2:])
    inflow = (dt_step[..., None] * x_cells).view(*grouped, chunk_size, -1)  # [NC, G, H/G, Q, P]
    y = (decay * cb) @ inflow
    # S = sum_j exp(cs_last - cs_j) dt_j x_j ⊗ B_j.
    to_end = torch.exp(log_decay[..., -1:] - log_decay).view(*grouped, chunk_size, 1)
    chunk_states = ((to_end * inflow).transpose(-1, -2) @ b_cells).flatten(1, 2)
    return y, chunk_states


def _initial_states(ssm_state, state_indices, has_initial_state) -> torch.Tensor:
    """[R, H, P, N] float32: each request's slot, or zeros where it has no initial state."""
    num_reqs = state_indices.shape[0]
    initial = ssm_state.new_zeros(num_reqs, *ssm_state.shape[1:], dtype=torch.float32)
    has_initial = has_initial_state.bool()
    initial[has_initial] = ssm_state[state_indices.long()[has_initial]].float()
    return initial


def _pass_states(chunks: SSDChunks, chunk_states, chunk_log_decay, initial):
    """Carry each request's state across its chunks: ``h_out = exp(cs_last) h_in + S_chunk``.
    Returns the states entering and leaving every chunk ``[NC, H, P, N]`` and the final states
    ``[R, H, P, N]``; one step per chunk index, all requests at once."""
    states_in = torch.empty_like(chunk_states)
    states_out = torch.empty_like(chunk_states)
    final = initial.clone()
    first_chunk, num_chunks = chunks.first_chunk.long(), chunks.num_chunks.long()
    for k in range(int(num_chunks.max()) if num_chunks.numel() else 0):
        active = torch.nonzero(num_chunks > k).squeeze(1)
        chunk = first_chunk[active] + k
        state = final.index_select(0, active)  # [A, H, P, N]
        states_in.index_copy_(0, chunk, state)
        decay = chunk_log_decay.index_select(0, chunk).exp()[:, :, None, None]  # [A, H, 1, 1]
        state = decay * state + chunk_states.index_select(0, chunk)
        states_out.index_copy_(0, chunk, state)
        final.index_copy_(0, active, state)
    return states_in, states_out, final


def check_ssd_shapes(x, dt, B, C, ssm_state) -> None:
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    if num_groups < 1 or num_heads % num_groups:
        raise ValueError(f"{num_heads} heads do not split into {num_groups} groups.")
    if dt.shape != (num_tokens, num_heads) or B.shape != C.shape or B.shape[0] != num_tokens:
        raise ValueError(
            f"x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)} and C "
            f"{tuple(C.shape)} disagree on tokens, heads or groups."
        )
    if tuple(ssm_state.shape[1:]) != (num_heads, head_dim, state_size):
        raise ValueError(
            f"ssm_state {tuple(ssm_state.shape)} is not [S, {num_heads}, {head_dim}, {state_size}]."
        )
