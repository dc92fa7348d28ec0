"""What every cache-bound layer needs during one forward pass, set by the runner around it.

The model's modules are plain math and never see the step plan; each cache layer looks up its
KV-cache group's part of the step here by layer name: the metadata it reads (block table, slot
mapping, sequence lengths; state slots...) and the kernels it calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from workers.group_step import GroupStep


@dataclass(frozen=True)
class ForwardContext:
    steps_by_layer: Mapping[str, GroupStep]  # layer name -> its KV-cache group's step
    # The forward is a decode graph's region (``workers.cuda_graphs``): what it computes is
    # replayed, so no layer may read the device back or keep host-side state of a step.
    is_graph_region: bool = False

    def step_for(self, layer_name: str) -> GroupStep:
        return self.steps_by_layer[layer_name]


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context (use set_forward_context)")
    return _current


def in_graph_region() -> bool:
    """Whether the forward running now is a decode graph's region (False outside any)."""
    return _current is not None and _current.is_graph_region


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    previous, _current = _current, context
    try:
        yield
    finally:
        _current = previous
