"""Rotary position embedding (the half-split form used by Llama-family checkpoints)."""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default",)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hk, D]`` rotated by their positions."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = angles.cos().to(query.dtype)[:, None, :]  # [T, 1, D]
        sin = angles.sin().to(query.dtype)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
