"""The attention layer: rank-local heads, the layer's KV-cache view, and a call into the step's
attention backend (its group's kernels, ``workers.kinds.attention``), which writes the new K/V
into the cache and attends through block tables."""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention.params import AttentionParams
from workers.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        # sinks: one logit per query head of this rank (gpt-oss), loaded in place later.
        self.params = AttentionParams(
            scale=scale, num_kv_heads=num_kv_heads, sliding_window=sliding_window, sinks=sinks
        )
        self.kv_cache: torch.Tensor | None = None  # [B, H, N, C] view, bound at allocation

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``query`` ``[T, Hq, D]``, ``key``/``value`` ``[T, Hk, D]`` -> ``[T, Hq * D]``."""
        step = get_forward_context().step_for(self.layer_name)
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound (allocate it first)")
        output = step.kernels.forward(query, key, value, self.kv_cache, step.metadata, self.params)
        return output.reshape(query.shape[0], self.num_heads * self.head_size)
