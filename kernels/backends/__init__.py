"""Attention backends by name. A backend's module is imported only when it is chosen, so
choosing ``torch`` never imports triton."""

from __future__ import annotations

import importlib

from kernels.backends.base import (
    AttentionBackend,
    MultipleOf,
    UnknownAttentionBackendError,
    UnsupportedKVCacheError,
)

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("kernels.backends.torch_backend", "TorchAttentionBackend"),
    "triton": ("kernels.backends.triton_backend", "TritonAttentionBackend"),
}


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend called ``name`` (case-insensitive), or an error listing the valid names."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _BACKENDS:
        raise UnknownAttentionBackendError(
            f"Unknown attention backend {name!r}. Valid backends: {attention_backend_names()}"
        )
    module_name, class_name = _BACKENDS[key]
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = [
    "AttentionBackend",
    "MultipleOf",
    "UnknownAttentionBackendError",
    "UnsupportedKVCacheError",
    "attention_backend_names",
    "get_attention_backend",
]
