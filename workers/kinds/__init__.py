"""Every kind of cache layer kvray serves, in one table. A kind declares itself (spec factory,
step builder, kernels) in its own modules; adding one is those modules and a line here.
The worker core (runner, worker, profile) and the planning code ask this table, never a kind
by name."""

from __future__ import annotations

from kvcore import KVCacheSpec, iter_layer_specs
from workers.kinds.attention import ATTENTION
from workers.kinds.base import CacheKind, SpecContext, StateCaching
from workers.kinds.mamba import MAMBA
from workers.kinds.mla import MLA

KINDS: tuple[CacheKind, ...] = (ATTENTION, MAMBA, MLA)
# Layer types that keep no cache (a block that is only an MLP).
STATELESS_LAYER_TYPES = ("mlp",)

__all__ = ["KINDS", "CacheKind", "SpecContext", "StateCaching", "kind_of_layer", "kind_of_spec"]


def kind_of_layer(layer_type: str) -> CacheKind | None:
    """The kind serving a config's layer type; None for a layer that keeps no cache."""
    if layer_type in STATELESS_LAYER_TYPES:
        return None
    for kind in KINDS:
        if layer_type in kind.layer_types:
            return kind
    raise ValueError(f"No cache kind serves layer type {layer_type!r}")


def kind_of_spec(spec: KVCacheSpec) -> CacheKind:
    """The kind whose layers have ``spec`` (a group's spec: the kind of its layers), by the
    most specific spec class a kind names (an MLA spec is a full-attention spec too)."""
    first = next(iter(iter_layer_specs(spec)))
    for cls in type(first).__mro__:
        for kind in KINDS:
            if cls in kind.spec_types:
                return kind
    raise ValueError(f"No cache kind serves {type(first).__name__}")
