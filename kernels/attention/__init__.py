"""Attention backends by name. A backend's module is imported only when it is chosen, so
choosing ``torch`` never imports triton."""

from __future__ import annotations

from kernels.attention.base import (
    AttentionBackend,
    MultipleOf,
    UnknownAttentionBackendError,
    UnsupportedKVCacheError,
)
from kernels.registry import BackendRegistry

_REGISTRY = BackendRegistry(
    "attention",
    {
        "torch": ("kernels.attention.torch_backend", "TorchAttentionBackend"),
        "triton": ("kernels.attention.triton_backend", "TritonAttentionBackend"),
    },
    UnknownAttentionBackendError,
)


def attention_backend_names() -> list[str]:
    return _REGISTRY.names()


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend called ``name`` (case-insensitive), or an error listing the valid names."""
    return _REGISTRY.get(name)


__all__ = [
    "AttentionBackend",
    "MultipleOf",
    "UnknownAttentionBackendError",
    "UnsupportedKVCacheError",
    "attention_backend_names",
    "get_attention_backend",
]
