"""Torch reference of the Mamba-2 causal depthwise conv1d (+ SiLU): the torch backend's compute
and what the Triton kernels are checked against.

Prefill lays each request's K-1 state rows in front of its new tokens in one packed buffer, so
every output is a gather of K rows and every state to write (final or checkpoint) is a slice of
K-1 consecutive rows of that buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mamba.base import ConvWeights, VarlenBatch


def conv1d_prefill_reference(
    x: torch.Tensor,
    conv: ConvWeights,
    conv_state: torch.Tensor,
    batch: VarlenBatch,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MambaBackend.conv1d_prefill``: ``silu(conv(x) + bias)`` ``[T, D]``, states written."""
    weight, bias, state_indices = conv.weight, conv.bias, batch.state_indices
    has_initial_state, query_start_loc = batch.has_initial_state, batch.query_start_loc
    checkpoints = batch.checkpoints
    num_tokens, dim = x.shape
    width = check_conv_shapes(x, weight, conv_state)
    history = width - 1
    starts = query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]  # [R]
    num_reqs = query_lens.shape[0]
    # Request r's rows in the packed buffer: K-1 state rows, then its tokens.
    padded_start = starts[:-1] + history * torch.arange(num_reqs, device=x.device)  # [R]
    token_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=x.device), query_lens, output_size=num_tokens
    )  # [T]
    token_row = torch.arange(num_tokens, device=x.device) + history * (token_req + 1)  # [T]

    packed = x.new_zeros(num_tokens + history * num_reqs, dim, dtype=torch.float32)
    state_rows = padded_start[:, None] + torch.arange(history, device=x.device)  # [R, K-1]
    has_initial = has_initial_state.bool()  # the others stay zeros, their slots unread
    packed[state_rows[has_initial]] = conv_state[state_indices.long()[has_initial]].float()
    packed[token_row] = x.float()

    taps = token_row[:, None] - history + torch.arange(width, device=x.device)  # [T, K]
    conv = torch.einsum("tkd,dk->td", packed[taps], weight.float())
    if bias is not None:
        conv = conv + bias.float()
    out = torch.empty_like(x) if out is None else out
    out.copy_(F.silu(conv))

    window = torch.arange(history, device=x.device)
    if checkpoints is not None and checkpoints.numel():
        req, consumed, slot = checkpoints.long().unbind(1)
        rows = padded_start[req, None] + consumed[:, None] + window  # [M, K-1]
        conv_state[slot] = packed[rows].to(conv_state.dtype)
    final_rows = padded_start[:, None] + query_lens[:, None] + window  # [R, K-1]
    conv_state[state_indices.long()] = packed[final_rows].to(conv_state.dtype)
    return out


def conv1d_decode_reference(
    x: torch.Tensor,
    conv: ConvWeights,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``MambaBackend.conv1d_decode``: one token per request, each slot's window shifted."""
    weight, bias = conv.weight, conv.bias
    check_conv_shapes(x, weight, conv_state)
    slots = state_indices.long()
    window = torch.cat([conv_state[slots].float(), x.float()[:, None]], dim=1)  # [R, K, D]
    conv = torch.einsum("rkd,dk->rd", window, weight.float())
    if bias is not None:
        conv = conv + bias.float()
    conv_state[slots] = window[:, 1:].to(conv_state.dtype)
    out = torch.empty_like(x) if out is None else out
    out.copy_(F.silu(conv))
    return out


def check_conv_shapes(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> int:
    """The kernel width K, once x ``[T, D]``, weight ``[D, K]`` and conv_state
    ``[S, K-1, D]`` agree."""
    dim, width = weight.shape
    if x.ndim != 2 or x.shape[1] != dim or width < 2:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree.")
    if conv_state.ndim != 3 or tuple(conv_state.shape[1:]) != (width - 1, dim):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} is not [S, {width - 1}, {dim}].")
    return width
