"""The torch mixture-of-experts path: the router's top-k, and the experts run one after the
other over the tokens routed to each (sorted by expert, so each expert is one matmul pair over
its tokens). Results are added back per token in expert order, as transformers adds them, so a
single rank reproduces its sums exactly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation import activate


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


def top_k_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the ``top_k`` largest logits, weighted by a softmax over those ``k`` alone."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def group_limited_top_k(
    router_logits: torch.Tensor, top_k: int, num_groups: int, top_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's ``group_limited_greedy``: softmax scores; the experts split into
    ``num_groups`` equal groups, each ranked by its best score; the ``top_k`` best experts of
    the ``top_groups`` best groups, weighted by their scores (float32)."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    grouped = scores.view(scores.shape[0], num_groups, -1)
    chosen = _group_mask(grouped.max(dim=-1).values, top_groups, grouped.shape[-1])
    weights, ids = torch.topk(scores.masked_fill(~chosen, 0.0), top_k, dim=-1, sorted=False)
    return weights, ids


def biased_group_top_k(
    router_logits: torch.Tensor,
    score_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    top_groups: int,
    *,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's ``noaux_tc``: sigmoid scores; the choice is made on scores plus
    ``score_bias``, groups ranked by the sum of their two best, the ``top_k`` best experts of
    the ``top_groups`` best groups; the weights are the chosen experts' unbiased scores
    (renormalised to sum to 1 when asked; float32)."""
    scores = router_logits.float().sigmoid()
    for_choice = scores + score_bias.float()
    grouped = for_choice.view(scores.shape[0], num_groups, -1)
    chosen = _group_mask(grouped.topk(2, dim=-1)[0].sum(dim=-1), top_groups, grouped.shape[-1])
    ids = torch.topk(for_choice.masked_fill(~chosen, float("-inf")), top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


def _group_mask(group_scores: torch.Tensor, top_groups: int, group_size: int) -> torch.Tensor:
    """[T, E] True for the experts of each token's ``top_groups`` best groups."""
    best = torch.topk(group_scores, top_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.repeat_interleave(group_size, dim=-1)


ACTIVATIONS = ("silu", "relu2", "swiglu_oai")


@dataclass(frozen=True)
class ExpertKind:
    """How an expert computes from its projections: ``act(gate) * up`` when ``gated`` (SiLU),
    ``act(up)`` when not (relu²), or gpt-oss's clamped SwiGLU (``swiglu_oai``:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``, g = ``min(gate, limit)``)."""

    gated: bool = True
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


GATED_SILU = ExpertKind()


def expert_inner(projected: torch.Tensor, kind: ExpertKind) -> torch.Tensor:
    """An expert's intermediate rows from its gate/up projection (gate columns, then up)."""
    if not kind.gated:
        return activate(projected, kind.activation)
    gate, up = projected.chunk(2, dim=-1)
    if kind.activation == "swiglu_oai":
        gate = gate.clamp(max=kind.limit)
        up = up.clamp(min=-kind.limit, max=kind.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * kind.alpha))
    return activate(gate, kind.activation) * up


def grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    kind: ExpertKind = GATED_SILU,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    project: Callable[[torch.Tensor, int, str], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])`` for every token t.

    hidden [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows), or [E, I, H]
    (up rows only) when not ``kind.gated``; w2 [E, H, I]; an expert is
    ``w2 @ inner(w13 x + b13) + b2`` (``expert_inner``; the biases [E, 2I] and [E, H] are
    gpt-oss's, None elsewhere). ``project(rows, e, "w13" | "w2")``, when given, computes
    ``rows @ W[e]^T`` instead of ``F.linear`` (a CPU worker's oneDNN-packed weights; ``w13``
    and ``w2`` then only give the expert count). An id of E or more names an expert held
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
        if project is None:
            projected = F.linear(hidden[tokens], w13[expert], _row(b13, expert))
            inner = expert_inner(projected, kind)
            expert_out = F.linear(inner, w2[expert], _row(b2, expert))
        else:
            projected = _plus(project(hidden[tokens], expert, "w13"), _row(b13, expert))
            inner = expert_inner(projected, kind)
            expert_out = _plus(project(inner, expert, "w2"), _row(b2, expert))
        out.index_add_(0, tokens, expert_out * weights[pairs, None])
    return out


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def _plus(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias
