"""Multi-head latent attention (DeepSeek-V2/V3) kernels: the latent cache write and the
absorbed-weight split-KV decode, each Triton kernel beside its torch reference, behind
``MLABackend``.

Backends by name, as for attention: a backend's module is imported only when it is chosen, so
``torch`` never imports triton.
"""

from __future__ import annotations

from kernels.mla.base import DEFAULT_NUM_SPLITS, MLABackend, UnknownMLABackendError
from kernels.registry import BackendRegistry

_REGISTRY = BackendRegistry(
    "MLA",
    {
        "torch": ("kernels.mla.torch_backend", "TorchMLABackend"),
        "triton": ("kernels.mla.triton_backend", "TritonMLABackend"),
    },
    UnknownMLABackendError,
)


def mla_backend_names() -> list[str]:
    return _REGISTRY.names()


def get_mla_backend(name: str) -> MLABackend:
    """A new backend called ``name`` (case-insensitive), or an error listing the valid names."""
    return _REGISTRY.get(name)


__all__ = [
    "DEFAULT_NUM_SPLITS",
    "MLABackend",
    "UnknownMLABackendError",
    "get_mla_backend",
    "mla_backend_names",
]
