"""Applying a token bitmask to logits: plain tensor ops, so the same code runs on any device
(on a GPU, a handful of elementwise kernels over ``[C, vocab]``, next to nothing beside a
forward). Bit ``i % 32`` of word ``i // 32`` set means token ``i`` is allowed (xgrammar's
layout)."""

from __future__ import annotations

import torch

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[C, vocab_size]`` bool from an int32 bitmask ``[C, W]``; columns past the mask's
    ``W * 32`` are not allowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit is bit 31
    allowed = bits.bool().flatten(1)[:, :vocab_size]
    if allowed.shape[1] < vocab_size:
        pad = torch.zeros((allowed.shape[0], vocab_size - allowed.shape[1]), dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(allowed.device)], dim=1)
    return allowed


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """``logits`` ``[R, V]`` with the tokens ``bitmask`` (``[C, W]``, one row per entry of
    ``rows``, int64 row indices) disallows set to -inf; other rows are untouched. Returns a
    new tensor."""
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    selected = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, selected)
