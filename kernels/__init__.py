"""kvray kernels: Triton paged attention and cache writes, with torch references beside them.

Kernels read the KV cache only through the strides of kvcore's per-layer views, so every one of
the six layouts runs through the same code. Importing this package imports torch but neither
triton (loaded only with the triton backend or the kernel modules) nor ray.
"""

from __future__ import annotations

from kernels.attention import (
    AttentionBackend,
    MultipleOf,
    UnknownAttentionBackendError,
    UnsupportedKVCacheError,
    attention_backend_names,
    get_attention_backend,
)
from kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from kernels.attention.params import AttentionParams

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionParams",
    "MultipleOf",
    "UnknownAttentionBackendError",
    "UnsupportedKVCacheError",
    "attention_backend_names",
    "build_attention_metadata",
    "get_attention_backend",
]
