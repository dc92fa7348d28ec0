"""RMSNorm, computed in float32 and cast back, as the reference implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``scale_in_float32``: multiply by the weight before casting back (NemotronH), not after
    (Llama); the two differ only below float32."""

    def __init__(
        self, hidden_size: int, eps: float, *, dtype: torch.dtype, scale_in_float32: bool = False
    ):
        super().__init__()
        self.eps = eps
        self.scale_in_float32 = scale_in_float32
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same arithmetic in one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight.float() * x32).to(input_dtype)
        return self.weight * x32.to(input_dtype)
