"""Mixture-of-experts kernels: choosing each token's experts from the router's logits, and
running the chosen experts (gate and up projections, SiLU, down projection, the router-weighted
sum back per token). ``reference`` is the torch path, grouped by expert, which CPUs run;
``triton_moe`` the fused kernels GPUs run. ``run_experts`` picks by the tensors' device, so
a CPU worker never imports triton."""

from __future__ import annotations

import torch

from kernels.moe.reference import activate, grouped_experts, select_experts


def run_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gated: bool = True,
    activation: str = "silu",
) -> torch.Tensor:
    """``grouped_experts``'s result: fused in Triton on a GPU, grouped torch on the CPU."""
    kind = dict(gated=gated, activation=activation)
    if hidden.is_cuda:
        from kernels.moe.triton_moe import fused_experts

        return fused_experts(hidden, w13, w2, topk_weights, topk_ids, **kind)
    return grouped_experts(hidden, w13, w2, topk_weights, topk_ids, **kind)


__all__ = ["activate", "grouped_experts", "run_experts", "select_experts"]
