"""A worker's KV cache: one raw byte buffer, one view per cache layer (attention K/V, or a
recurrent layer's state page), bound to the layer.

The plan (``KVCacheConfig``) comes from the controller; this module only executes it. Where the
attention backend needs blocks smaller than the scheduler's, each group's views are split into
kernel blocks (kvcore refuses layouts that cannot be split).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention import AttentionBackend, MultipleOf
from kvcore import KVCacheConfig, create_kv_cache_views
from kvcore._math import round_up
from workers.kinds import kind_of_spec

ALLOCATION_ALIGNMENT = 4096


def select_kernel_block_size(block_size: int, backend: AttentionBackend) -> int:
    """The manager block size if the backend takes it, else its largest int size dividing it."""
    supported = backend.supported_kernel_block_sizes()
    for allowed in supported:
        if isinstance(allowed, MultipleOf) and block_size % allowed.base == 0:
            return block_size
        if allowed == block_size:
            return block_size
    for allowed in sorted((s for s in supported if isinstance(s, int)), reverse=True):
        if block_size % allowed == 0:
            return allowed
    raise ValueError(
        f"No kernel block size of the {backend.name} backend divides block size {block_size}; "
        f"supported: {list(supported)}"
    )


def allocate_kv_cache(
    config: KVCacheConfig,
    layers: dict[str, nn.Module],
    backend: AttentionBackend,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Allocate the buffer, build and bind every layer's view; returns the raw buffer."""
    backend.check_kv_cache_layout(config.layout)
    if not config.kv_cache_tensors:
        return torch.zeros(0, dtype=torch.int8, device=device)
    sizes = {tensor.size for tensor in config.kv_cache_tensors}
    if len(sizes) != 1:
        raise ValueError(f"KV cache tensors must share one backing allocation, got sizes {sizes}")
    raw = torch.zeros(round_up(sizes.pop(), ALLOCATION_ALIGNMENT), dtype=torch.int8, device=device)
    for tensor in config.kv_cache_tensors:
        group = config.kv_cache_groups[config.group_of(tensor.layers[0])]
        spec = group.layer_spec(tensor.layers[0])
        kernel_block_size = None  # a recurrent state is one page per block, never split
        if kind_of_spec(spec).splits_into_kernel_blocks:
            kernel_block_size = select_kernel_block_size(spec.block_size, backend)
        views = create_kv_cache_views(
            raw, spec, config.num_blocks, config.layout, tensor, kernel_block_size
        )
        for name, view in views.items():
            if name not in layers:
                raise ValueError(f"The KV cache plan names layer {name!r}, which the model lacks")
            layers[name].kv_cache = view
    unbound = [name for name, layer in layers.items() if layer.kv_cache is None]
    if unbound:
        raise ValueError(f"The KV cache plan leaves layers without a cache: {unbound}")
    return raw
