"""Triton Mamba-2 SSD prefill: the chunked pipeline over a varlen batch.

Five launches over the chunk table of ``kernels.mamba.chunks`` (chunks aligned to absolute
positions, never crossing requests): dt' and the running sum of dA per chunk, each chunk's own
state, ``C·Bᵀ`` per chunk, the state passing across each request's chunks (reading initial
states and writing final states and checkpoints through the slots' strides), and the output
scan. Scratch is float32; states keep the slot's dtype. The torch reference is
``kernels.mamba.ssd_reference.ssd_prefill_reference``.
"""

from __future__ import annotations

import torch

from kernels.mamba.base import SSDParams, VarlenBatch
from kernels.mamba.ssd_reference import check_ssd_shapes
from kernels.mamba.triton_ssd_chunk import chunk_cb, chunk_cumsum, chunk_states
from kernels.mamba.triton_ssd_scan import chunk_scan, pass_states


def ssd_prefill(
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
    """``MambaBackend.ssd_prefill`` (see ``kernels.mamba.base``), into ``out`` if given."""
    check_ssd_shapes(x, dt, B, C, ssm_state)
    if ssm_state.stride(-1) != 1:
        raise ValueError(f"ssm_state's last dim must be contiguous: strides {ssm_state.stride()}.")
    out = torch.empty_like(x) if out is None else out
    chunks = batch.ssd_chunks()
    if batch.state_indices.shape[0] == 0:
        return out
    dt_step, cum = chunk_cumsum(dt, params.dt_bias, params.A, chunks, params.dt_min)  # [NC, H, Q]
    states = chunk_states(x, B, dt_step, cum, chunks)  # [NC, H, P, N]
    cb = chunk_cb(C, B, chunks)  # [NC, G, Q, Q]
    pass_states(states, cum, ssm_state, batch.state_indices, batch.has_initial_state, chunks)
    chunk_scan(out, x, C, params.D, cb, cum, dt_step, states, chunks)  # states: entering each
    return out
