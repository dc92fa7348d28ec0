"""The static attention settings of one layer, handed to every forward of that layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionParams:
    """What a model layer fixes at construction; the batch comes in ``AttentionMetadata``.

    ``num_kv_heads`` may be fewer than the cache's head slots (a backend may pad H); query heads
    ``h`` read KV head ``h // (num_q_heads // num_kv_heads)``. A sliding window of W lets a query
    at position p see keys at ``p - W < k <= p``. ``softcap`` maps a logit x to
    ``softcap * tanh(x / softcap)``. ``sinks`` holds one logit per query head that joins the
    softmax denominator and contributes no value.
    """

    scale: float
    num_kv_heads: int
    head_size_v: int | None = None  # None: same as the query's head size
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_q_heads], any float dtype

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be positive, got {self.num_kv_heads}.")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}.")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be positive, got {self.softcap}.")

    def resolve_head_size_v(self, head_size: int) -> int:
        return head_size if self.head_size_v is None else self.head_size_v
