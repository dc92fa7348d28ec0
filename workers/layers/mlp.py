"""The dense MLP of a decoder layer, or of an MoE layer's shared experts: gated
(``down(act(gate x) * up x)``: Llama's SiLU, with gate and up in one column-parallel matrix) or
not (``down(act(up x))``: NemotronH's relu²). The intermediate rows split over the TP group;
the down projection's all-reduce sums them."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import activate, gated
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool,
        activation: str,
        bias: bool,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.activation = activation
        self.gate_up_proj = self.up_proj = None
        if gated:
            widths = [intermediate_size, intermediate_size]
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden_size, widths, bias=bias, dtype=dtype
            )
        else:
            self.up_proj = ColumnParallelLinear(
                hidden_size, intermediate_size, bias=bias, dtype=dtype
            )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(activate(self.up_proj(x), self.activation))
        return self.down_proj(gated(self.gate_up_proj(x), self.activation))
