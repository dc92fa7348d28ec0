"""A forward pass over a full step's worth of tokens, without a KV cache, so the peak
activation memory can be measured before the cache takes the rest of the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.forward_context import ForwardContext, set_forward_context


class _CachelessAttention:
    """Causal attention over the step's own tokens (one sequence); touches no cache."""

    def forward(self, query, key, value, kv_cache, metadata, params):
        groups = query.shape[1] // key.shape[1]
        q = query.transpose(0, 1)  # [T, Hq, D] -> [Hq, T, D]
        k = key.repeat_interleave(groups, dim=1).transpose(0, 1)
        v = value.repeat_interleave(groups, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=params.scale)
        return out.transpose(0, 1)  # [T, Hq, D]


class _AnyLayer(dict):
    def __missing__(self, key):
        return None


def profile_forward(model, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Run ``model`` on ``num_tokens`` dummy tokens; returns the logits of the last one."""
    token_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    context = ForwardContext(
        backend=_CachelessAttention(), metadata_by_layer=_AnyLayer(), requires_kv_cache=False
    )
    with torch.inference_mode(), set_forward_context(context):
        hidden = model(token_ids, positions)
        return model.compute_logits(hidden[-1:])
