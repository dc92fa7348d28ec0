"""Torch references beside the Triton kernels, and the dense float64 oracle the tests trust.

``write_kv_reference`` and ``paged_attention_reference`` are the torch backend's own compute
(the fast CPU path) and the Triton kernels' reference: same contracts, plain torch indexing
through the view's strides. ``dense_attention_float64`` knows nothing about pages: it attends
over one request's contiguous K and V, written as plainly as possible.
"""

from __future__ import annotations

import torch

from kernels.attention.cache_view import check_kv_cache, check_query_heads
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams


def write_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token t's K [H, head_size] and V [H, head_size_v] at ``slot_mapping[t]``.

    A slot is ``block_id * block_size + offset`` in manager blocks, which equals
    ``kernel_block_id * N + offset_in_kernel_block`` for a split view; -1 slots are skipped.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    head_size_v = value.shape[-1]
    check_kv_cache(kv_cache, num_kv_heads, head_size, head_size_v)
    if value.shape[:2] != key.shape[:2] or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must agree on tokens and heads."
        )
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real].to(torch.int64)
    kernel_block_size = kv_cache.shape[2]
    blocks, offsets = slots // kernel_block_size, slots % kernel_block_size
    cells = kv_cache[:, :num_kv_heads]  # [B, H, N, C], still a view of the cache
    cells[blocks, :, offsets, :head_size] = key[is_real].to(kv_cache.dtype)
    cells[blocks, :, offsets, head_size : head_size + head_size_v] = value[is_real].to(
        kv_cache.dtype
    )


def gather_request_kv(
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    seq_len: int,
    block_size: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """One request's cells for positions ``0 .. seq_len - 1``: ``[seq_len, num_kv_heads, C]``."""
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_row.to(kv_cache.device, torch.int64)[positions // block_size]
    slots = blocks * block_size + positions % block_size
    kernel_block_size = kv_cache.shape[2]
    return kv_cache[slots // kernel_block_size, :num_kv_heads, slots % kernel_block_size]


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    params: AttentionParams,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged K/V, computed in fp32.

    ``query`` is ``[num_tokens, num_q_heads, head_size]``; the result is
    ``[num_tokens, num_q_heads, head_size_v]`` in the query's dtype. Rows past the batch's
    actual tokens are left as they were.
    """
    num_q_heads, head_size = query.shape[1:]
    head_size_v = params.resolve_head_size_v(head_size)
    check_kv_cache(kv_cache, params.num_kv_heads, head_size, head_size_v)
    check_query_heads(num_q_heads, params.num_kv_heads)
    if out is None:
        out = torch.empty(
            (query.shape[0], num_q_heads, head_size_v), dtype=query.dtype, device=query.device
        )
    starts = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        if starts[i + 1] == starts[i]:
            continue
        cells = gather_request_kv(
            kv_cache, metadata.block_table[i], seq_len, metadata.block_size, params.num_kv_heads
        )
        key = cells[..., :head_size].float()
        value = cells[..., head_size : head_size + head_size_v].float()
        request_out = attend_one_request(
            query[starts[i] : starts[i + 1]].float(), key, value, params
        )
        out[starts[i] : starts[i + 1]] = request_out.to(out.dtype)
    return out


def attend_one_request(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: AttentionParams
) -> torch.Tensor:
    query_len, num_q_heads, head_size = query.shape
    seq_len, num_kv_heads, head_size_v = value.shape
    group = num_q_heads // num_kv_heads
    query = query.view(query_len, num_kv_heads, group, head_size)  # [Q, Hq, D] -> [Q, Hkv, G, D]
    scores = torch.einsum("qhgd,shd->hgqs", query, key) * params.scale  # [Hkv, G, Q, S]
    if params.softcap is not None:
        scores = params.softcap * torch.tanh(scores / params.softcap)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    is_visible = key_pos <= query_pos
    if params.sliding_window is not None:
        is_visible &= key_pos > query_pos - params.sliding_window
    scores = scores.masked_fill(~is_visible, float("-inf"))
    if params.sinks is not None:
        # The sink is one more logit per head with no value behind it: [Hkv, G, Q, S + 1].
        sinks = params.sinks.to(scores.device, torch.float32).view(num_kv_heads, group, 1, 1)
        sinks = sinks.expand(-1, -1, query_len, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :seq_len]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqs,shd->qhgd", probs, value)  # [Q, Hkv, G, Dv]
    return out.reshape(query_len, num_q_heads, head_size_v)


def dense_attention_float64(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """One request, contiguous K/V: ``[Q, Hq, D]``, ``[S, Hkv, D]``, ``[S, Hkv, Dv]`` ->
    ``[Q, Hq, Dv]`` in float64, head by head with an explicit max-shifted softmax."""
    query, key, value = query.double(), key.double(), value.double()
    query_len, num_q_heads, _ = query.shape
    seq_len, num_kv_heads, head_size_v = value.shape
    device = query.device
    out = torch.empty((query_len, num_q_heads, head_size_v), dtype=torch.float64, device=device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if params.sliding_window is not None:
        allowed = allowed & (query_pos - key_pos < params.sliding_window)
    for head in range(num_q_heads):
        kv_head = head * num_kv_heads // num_q_heads
        logits = query[:, head] @ key[:, kv_head].T * params.scale  # [Q, S]
        if params.softcap is not None:
            logits = params.softcap * torch.tanh(logits / params.softcap)
        logits = torch.where(allowed, logits, torch.full_like(logits, -torch.inf))
        peak = logits.max(dim=-1, keepdim=True).values
        sink = None if params.sinks is None else float(params.sinks[head])
        if sink is not None:
            peak = torch.clamp(peak, min=sink)
        weights = torch.exp(logits - peak)
        denominator = weights.sum(dim=-1, keepdim=True)
        if sink is not None:
            denominator = denominator + torch.exp(sink - peak)
        out[:, head] = weights @ value[:, kv_head] / denominator
    return out
