"""What every cache-bound layer needs during one forward pass, set by the runner around it.

The model's modules are plain math and never see the step plan; the attention and Mamba layers
look up their group's metadata here (block table, slot mapping, sequence lengths; state slots)
by layer name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForwardContext:
    backend: Any  # the attention backend serving this forward
    metadata_by_layer: Mapping[str, Any]  # layer name -> its KV-cache group's step metadata
    mamba_backend: Any = None  # the Mamba kernels (kernels.mamba), for hybrid models
    mla_backend: Any = None  # the latent-cache kernels (kernels.mla), for DeepSeek models


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context (use set_forward_context)")
    return _current


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous
