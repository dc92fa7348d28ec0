"""The MLP activations kvray's models use, shared by the dense MLPs (``workers.layers.mlp``)
and the experts' kernels (``kernels.moe``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """SiLU, or NemotronH's relu² (``relu(x) ** 2``)."""
    return F.silu(x) if activation == "silu" else torch.square(F.relu(x))


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``activate(gate) * up`` of rows laid out ``[gate | up]``: SiLU's on CPUs in one C pass
    (``kernels.decoder.cpu_decoder.gated_silu``), everything else through torch."""
    if activation == "silu" and gate_up.device.type == "cpu":
        # Imported here: the C kernels build at first use, and GPU workers never need them.
        from kernels.decoder.cpu_decoder import gated_silu

        fused = gated_silu(gate_up)
        if fused is not None:
            return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return activate(gate, activation) * up
