"""Torch references for the MLA kernels, and the torch backend's own compute (the CPU path).

Same contracts as the Triton launchers (``kernels.mla.base``), written as plain indexing
through the view's strides and one softmax per request, with no splits: the Triton decode's
split-and-merge must reproduce exactly this.
"""

from __future__ import annotations

import torch

from kernels.attention.reference import gather_request_kv
from kernels.mla.base import as_latent_view, check_decode_args, check_write_args


def write_latent_reference(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[kv_c[t] | k_pe[t]]`` at ``slot_mapping[t]``; -1 slots are skipped."""
    check_write_args(kv_c, k_pe, slot_mapping)
    latent_size, rope_size = kv_c.shape[1], k_pe.shape[1]
    cells = as_latent_view(kv_cache, latent_size, rope_size)[:, 0]  # [B, N, C], still a view
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real].to(torch.int64)
    kernel_block_size = cells.shape[1]
    blocks, offsets = slots // kernel_block_size, slots % kernel_block_size
    cells[blocks, offsets, :latent_size] = kv_c[is_real].to(cells.dtype)
    cells[blocks, offsets, latent_size : latent_size + rope_size] = k_pe[is_real].to(cells.dtype)


def mla_decode_reference(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode, request by request in fp32 (float64 for float64 queries).
    ``num_splits`` is checked and otherwise unused: the whole context is one softmax."""
    check_decode_args(q_latent, q_pe, block_table, seq_lens, num_splits, out)
    latent_size, rope_size = q_latent.shape[-1], q_pe.shape[-1]
    view = as_latent_view(kv_cache, latent_size, rope_size)
    compute_dtype = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q_latent)
    for i, seq_len in enumerate(seq_lens.tolist()):
        cells = gather_request_kv(view, block_table[i], seq_len, block_size, 1)[:, 0]  # [S, C]
        latent = cells[:, :latent_size].to(compute_dtype)  # keys' first part, and the values
        rope = cells[:, latent_size : latent_size + rope_size].to(compute_dtype)
        scores = (
            q_latent[i].to(compute_dtype) @ latent.T + q_pe[i].to(compute_dtype) @ rope.T
        ) * scale  # [Hq, S]
        probs = torch.softmax(scores, dim=-1)
        out[i] = (probs @ latent).to(out.dtype)  # [Hq, L]; zeros when S == 0
    return out
