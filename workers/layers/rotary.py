"""Rotary position embedding (the half-split form used by Llama-family checkpoints).

One instance serves every layer of a model: the cos and sin of a step's positions are
computed by the first layer and reused by the others (the runner hands all layers the same
``positions`` tensor), instead of evaluating two transcendental functions per layer.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default",)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)
        self._step: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hk, D]`` rotated by their positions."""
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every head of ``x`` ``[T, H, D]`` rotated by its token's position."""
        cos, sin = self._cos_sin(positions)
        cos = cos.to(x.dtype)[:, None, :]  # [T, 1, D]
        sin = sin.to(x.dtype)[:, None, :]
        return _rotate(x, cos, sin)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[T, D]`` tables of this step, computed once for all layers. The same tensor
        written again in place (its version moves) is a new step."""
        if self._step is not None:
            same, version, cos, sin = self._step
            if same is positions and version == positions._version:
                return cos, sin
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = angles.cos(), angles.sin()
        self._step = (positions, positions._version, cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
