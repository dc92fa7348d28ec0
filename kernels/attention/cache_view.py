"""The contract every kernel expects of a layer's cache view, checked before any launch.

A view is kvcore's ``[B, H, N, C]`` tensor of one layer (B kernel blocks, H head slots, N token
slots per kernel block, C elements with K in ``[:head_size]`` and V right after it). Its strides
are whatever the layout made them; nothing here asks for contiguity.
"""

from __future__ import annotations

import torch


def check_kv_cache(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, head_size_v: int
) -> None:
    """Refuse a view that cannot hold ``num_kv_heads`` heads of K (head_size) + V (head_size_v)."""
    if kv_cache.dim() != 4:
        raise ValueError(
            f"The KV cache view must be 4-D [B, H, N, C], got shape {tuple(kv_cache.shape)}."
        )
    _, num_slots, _, content_len = kv_cache.shape
    if num_slots < num_kv_heads:
        raise ValueError(
            f"The KV cache view has {num_slots} head slots, fewer than the layer's "
            f"{num_kv_heads} KV heads."
        )
    if content_len < head_size + head_size_v:
        raise ValueError(
            f"The KV cache view holds {content_len} elements per cell, fewer than K "
            f"({head_size}) + V ({head_size_v})."
        )


def check_query_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head; refuses head counts that do not group evenly."""
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{num_q_heads} query heads do not split evenly over {num_kv_heads} KV heads."
        )
    return num_q_heads // num_kv_heads
