"""The torch mixture-of-experts path: the router's top-k, and the experts run one after the
other over the tokens routed to each (sorted by expert, so each expert is one matmul pair over
its tokens). Results are added back per token in expert order, as transformers adds them, so a
single rank reproduces its sums exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts by softmax score (computed in float32) and their
    weights, renormalised to sum to 1 when ``renormalize``: ([T, k] weights in the logits'
    dtype, [T, k] expert ids)."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])`` for every token t.

    hidden [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I];
    an expert is ``w2 @ (silu(gate x) * up x)``. An id of E or more names an expert held
    elsewhere (expert parallelism): that choice adds nothing here. With I a rank's slice of
    every expert, or E its own experts, the result is that rank's partial sum (the caller
    all-reduces)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts[: w13.shape[0]]):  # sorted: held-elsewhere ids last
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, expert_out * weights[pairs, None])
    return out
