"""Mixture-of-experts kernels: choosing each token's experts from the router's logits, and
running the chosen experts (gate and up projections, SiLU, down projection, the router-weighted
sum back per token). ``reference`` is the torch path, grouped by expert, which CPUs run;
``triton_moe`` the fused kernels GPUs run. ``run_experts`` picks by the tensors' device, so
a CPU worker never imports triton."""

from __future__ import annotations

import torch

from kernels.moe.reference import (
    GATED_SILU,
    ExpertKind,
    activate,
    grouped_experts,
    select_experts,
)


def run_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    kind: ExpertKind = GATED_SILU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    project=None,
) -> torch.Tensor:
    """``grouped_experts``'s result: fused in Triton on a GPU, grouped torch on the CPU
    (through ``project``, a CPU worker's packed weights, when given)."""
    if hidden.is_cuda:
        from kernels.moe.triton_moe import fused_experts

        return fused_experts(hidden, w13, w2, topk_weights, topk_ids, kind=kind, b13=b13, b2=b2)
    return grouped_experts(
        hidden, w13, w2, topk_weights, topk_ids, kind=kind, b13=b13, b2=b2, project=project
    )


__all__ = ["ExpertKind", "activate", "grouped_experts", "run_experts", "select_experts"]
