"""The MLP activations kvray's models use, shared by the dense MLPs (``workers.layers.mlp``)
and the experts' kernels (``kernels.moe``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """SiLU, or NemotronH's relu² (``relu(x) ** 2``)."""
    return F.silu(x) if activation == "silu" else torch.square(F.relu(x))
