"""Multi-head latent attention over the paged latent cache: the layer writes each new token's
``[kv_c | k_pe]`` and attends every query one of two ways (``workers.kinds.mla_metadata``): decode
tokens in latent space with absorbed weights (the step's MLA backend, ``kernels.mla``), and
prefills by expanding their context to per-head K/V for the attention backend's paged prefill.

``kv_b_proj`` (``[H * (P + V), L]``, this rank's heads) supplies both halves of the absorption:
per head, its first P rows are ``W_UK`` (latent -> nope key), the other V rows ``W_UV`` (latent
-> value). A query's ``q_nope · (W_UK c)`` equals ``(q_nope W_UK) · c``, and ``Σ p (W_UV c)``
equals ``W_UV Σ p c``, which is why decode can stay in latent space.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.params import AttentionParams
from workers.forward_context import get_forward_context
from workers.kinds.mla_metadata import ExpandedPrefills, LatentQueries, MLAKernels, MLAMetadata
from workers.model_config import MLAConfig


class MLAAttention(nn.Module):
    def __init__(self, layer_name: str, num_heads: int, mla: MLAConfig, *, scale: float):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads  # this rank's query heads
        self.mla = mla
        self.scale = scale
        # The expanded prefill is ordinary attention with qk head P + R and v head V, every
        # query head with its own K/V.
        self.expanded_params = AttentionParams(
            scale=scale, num_kv_heads=num_heads, head_size_v=mla.v_head_dim
        )
        self.kv_cache: torch.Tensor | None = None  # [B, 1, N, C] latent view, bound at allocation

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        """``q_nope`` ``[T, H, P]`` and rotated ``q_pe`` ``[T, H, R]``; the normalised latent
        ``kv_c`` ``[T, L]`` and rotated ``k_pe`` ``[T, R]`` of the same tokens -> ``[T, H * V]``."""
        step = get_forward_context().step_for(self.layer_name)
        metadata: MLAMetadata = step.metadata
        kernels: MLAKernels = step.kernels
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound (allocate it first)")
        kernels.latent.write_latent(kv_c, k_pe, self.kv_cache, metadata.attention.slot_mapping)
        mla = self.mla
        weights = kv_b_weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        out = q_nope.new_empty((q_nope.shape[0], self.num_heads, mla.v_head_dim))
        if metadata.latent is not None:
            rows = metadata.latent
            latent = self._attend_latent(kernels, metadata, rows, q_nope, q_pe, weights)
            _put(out, rows.token_index, latent)
        if metadata.expanded is not None:
            prefills = metadata.expanded
            expanded = self._attend_expanded(kernels, prefills, q_nope, q_pe, kv_b_weight)
            _put(out, prefills.token_index, expanded)
        return out.flatten(1)

    def _attend_latent(
        self, kernels: MLAKernels, metadata: MLAMetadata, rows: LatentQueries, q_nope, q_pe, weights
    ) -> torch.Tensor:
        nope_size = self.mla.qk_nope_head_dim
        w_uk, w_uv = weights[:, :nope_size], weights[:, nope_size:]  # [H, P, L], [H, V, L]
        q_nope, q_pe = _take(q_nope, rows.token_index), _take(q_pe, rows.token_index)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, L]
        out_latent = torch.empty_like(q_latent)
        for start in range(0, q_latent.shape[0], rows.max_rows_per_call):
            part = slice(start, start + rows.max_rows_per_call)
            kernels.latent.decode(
                q_latent[part],
                q_pe[part],
                self.kv_cache,
                rows.block_table[part],
                rows.seq_lens[part],
                metadata.attention.block_size,
                self.scale,
                out=out_latent[part],
            )  # [n, H, L]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _attend_expanded(
        self, kernels: MLAKernels, prefills: ExpandedPrefills, q_nope, q_pe, kv_b_weight
    ) -> torch.Tensor:
        mla = self.mla
        latent_size, rope_size = mla.kv_lora_rank, mla.qk_rope_head_dim
        nope_size = mla.qk_nope_head_dim
        kernel_block_size = self.kv_cache.shape[2]
        slots = prefills.context_slots
        cells = self.kv_cache[:, 0]  # [B, N, C]
        latent = cells[slots // kernel_block_size, slots % kernel_block_size]  # [S, C]
        latent = latent.to(kv_b_weight.dtype)
        num_context = latent.shape[0]
        up = F.linear(latent[:, :latent_size], kv_b_weight).view(num_context, self.num_heads, -1)
        rope = latent[:, None, latent_size : latent_size + rope_size]
        # One cell per context token and head: [k_nope | k_pe | v], as a paged cache of
        # one-token blocks.
        cells = torch.cat(
            (up[..., :nope_size], rope.expand(-1, self.num_heads, -1), up[..., nope_size:]),
            dim=-1,
        ).unsqueeze(2)  # [S, H, 1, P + R + V]
        query = torch.cat(
            (_take(q_nope, prefills.token_index), _take(q_pe, prefills.token_index)), dim=-1
        )
        return kernels.attention.attend(query, cells, prefills.metadata, self.expanded_params)


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _put(out: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> None:
    if index is None:
        out.copy_(rows)
    else:
        out.index_copy_(0, index, rows.to(out.dtype))
