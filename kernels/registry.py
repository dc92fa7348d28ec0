"""What every kernel family's backends share: lookup by name, importing a backend's module only
when it is chosen (so ``torch`` never imports triton), and the check that a Triton kernel can
launch on a tensor's device."""

from __future__ import annotations

import importlib

import torch


class BackendRegistry:
    """Backends of one kind (attention, Mamba, MLA): name -> (module, class)."""

    def __init__(self, kind: str, backends: dict[str, tuple[str, str]], error: type[ValueError]):
        self.kind = kind
        self.backends = backends
        self.error = error  # raised for an unknown name

    def names(self) -> list[str]:
        return sorted(self.backends)

    def get(self, name: str):
        """A new backend called ``name`` (case-insensitive), or an error listing the names."""
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in self.backends:
            raise self.error(
                f"Unknown {self.kind} backend {name!r}. Valid backends: {self.names()}"
            )
        module_name, class_name = self.backends[key]
        return getattr(importlib.import_module(module_name), class_name)()


def check_can_launch(device: torch.device, kind: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if device.type == "cuda":
        return
    from kernels.triton_support import is_interpreted

    if not is_interpreted():
        raise RuntimeError(
            f"The triton {kind} backend cannot run on {device.type} tensors: it needs a CUDA "
            "GPU, or TRITON_INTERPRET=1 set before triton is first imported. Use the torch "
            "backend on CPU-only workers."
        )
