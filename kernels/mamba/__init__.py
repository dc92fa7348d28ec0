"""Mamba-2 (SSD) kernels for hybrid models: causal conv1d, the chunked SSD scan and the decode
state update, each Triton kernel beside its torch reference, behind ``MambaBackend``.

Backends by name, as for attention: a backend's module is imported only when it is chosen, so
``torch`` never imports triton.
"""

from __future__ import annotations

import importlib

from kernels.mamba.base import MambaBackend, UnknownMambaBackendError

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("kernels.mamba.torch_backend", "TorchMambaBackend"),
    "triton": ("kernels.mamba.triton_backend", "TritonMambaBackend"),
}


def mamba_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_mamba_backend(name: str) -> MambaBackend:
    """A new backend called ``name`` (case-insensitive), or an error listing the valid names."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _BACKENDS:
        raise UnknownMambaBackendError(
            f"Unknown Mamba backend {name!r}. Valid backends: {mamba_backend_names()}"
        )
    module_name, class_name = _BACKENDS[key]
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["MambaBackend", "UnknownMambaBackendError", "get_mamba_backend", "mamba_backend_names"]
