"""Mamba-2 (SSD) kernels for hybrid models: causal conv1d, the chunked SSD scan and the decode
state update, each Triton kernel beside its torch reference, behind ``MambaBackend``.

Backends by name, as for attention: a backend's module is imported only when it is chosen, so
``torch`` never imports triton.
"""

from __future__ import annotations

from kernels.mamba.base import (
    ConvWeights,
    MambaBackend,
    SSDParams,
    UnknownMambaBackendError,
    VarlenBatch,
)
from kernels.registry import BackendRegistry

_REGISTRY = BackendRegistry(
    "Mamba",
    {
        "torch": ("kernels.mamba.torch_backend", "TorchMambaBackend"),
        "triton": ("kernels.mamba.triton_backend", "TritonMambaBackend"),
    },
    UnknownMambaBackendError,
)


def mamba_backend_names() -> list[str]:
    return _REGISTRY.names()


def get_mamba_backend(name: str) -> MambaBackend:
    """A new backend called ``name`` (case-insensitive), or an error listing the valid names."""
    return _REGISTRY.get(name)


__all__ = [
    "ConvWeights",
    "MambaBackend",
    "SSDParams",
    "UnknownMambaBackendError",
    "VarlenBatch",
    "get_mamba_backend",
    "mamba_backend_names",
]
