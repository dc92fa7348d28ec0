"""A guard that fails when code reads the device back or builds tensors from host data: what a
CUDA graph cannot capture (the capture raises on a GPU; here it runs on CPU tensors, where
nothing would notice).

It watches two levels. Every aten op passes a ``TorchDispatchMode``: ops whose result needs
the device's values on the host (``.item()``'s ``_local_scalar_dense``, ``nonzero`` and
boolean-mask indexing, ``unique``, ``bincount``, ``repeat_interleave`` without its output
size) and ``torch.tensor(data)``'s ``lift_fresh`` (a host-to-device copy) are refused. And the
Python-level reads that never become an aten op on a CPU tensor (``.tolist()``, ``.numpy()``,
``bool``/``int``/``float`` of a tensor) and explicit synchronisation are patched to refuse.

A Triton kernel launched under the interpreter copies its tensors through the host itself;
the guard stands aside for the launch (on a GPU it is one asynchronous launch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(AssertionError):
    """Code inside a capturable region read the device back."""


SYNCING_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::nonzero_static",  # allowed on GPUs, but only with its size: refuse to be sure
    "aten::masked_select",
    "aten::bincount",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::lift_fresh",
    "aten::lift_fresh_copy",
}

PYTHON_READS = ("tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__")

_launching = [0]  # Triton launches in progress: the interpreter's own host copies pass


class _RefuseSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _launching[0]:
            return func(*args, **kwargs)
        name = func._schema.name
        if name in SYNCING_OPS:
            raise HostSyncError(f"{name} inside a capturable region")
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            raise HostSyncError("repeat_interleave without output_size inside a capturable region")
        if name == "aten::index" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1]
        ):
            raise HostSyncError("boolean-mask indexing inside a capturable region")
        return func(*args, **kwargs)


def _refuse(what: str, original=None):
    def refuse(*args, **kwargs):
        if _launching[0] and original is not None:
            return original(*args, **kwargs)
        raise HostSyncError(f"{what} inside a capturable region")

    return refuse


def _interpreted_launch(original):
    def launch(*args, **kwargs):
        _launching[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _launching[0] -= 1

    return launch


@contextmanager
def refuse_host_syncs() -> Iterator[None]:
    from triton.runtime.interpreter import GridExecutor

    with ExitStack() as stack:
        for name in PYTHON_READS:
            refuse = _refuse(f"Tensor.{name}", getattr(torch.Tensor, name))
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse))
        stack.enter_context(
            mock.patch.object(torch.cuda, "synchronize", _refuse("torch.cuda.synchronize"))
        )
        launch = _interpreted_launch(GridExecutor.__call__)
        stack.enter_context(mock.patch.object(GridExecutor, "__call__", launch))
        stack.enter_context(_RefuseSyncs())
        yield
