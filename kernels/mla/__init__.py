"""Multi-head latent attention (DeepSeek-V2/V3) kernels: the latent cache write and the
absorbed-weight split-KV decode, each Triton kernel beside its torch reference, behind
``MLABackend``.

Backends by name, as for attention: a backend's module is imported only when it is chosen, so
``torch`` never imports triton.
"""

from __future__ import annotations

import importlib

from kernels.mla.base import DEFAULT_NUM_SPLITS, MLABackend, UnknownMLABackendError

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("kernels.mla.torch_backend", "TorchMLABackend"),
    "triton": ("kernels.mla.triton_backend", "TritonMLABackend"),
}


def mla_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_mla_backend(name: str) -> MLABackend:
    """A new backend called ``name`` (case-insensitive), or an error listing the valid names."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _BACKENDS:
        raise UnknownMLABackendError(
            f"Unknown MLA backend {name!r}. Valid backends: {mla_backend_names()}"
        )
    module_name, class_name = _BACKENDS[key]
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = [
    "DEFAULT_NUM_SPLITS",
    "MLABackend",
    "UnknownMLABackendError",
    "get_mla_backend",
    "mla_backend_names",
]
