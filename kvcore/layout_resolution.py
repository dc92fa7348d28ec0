"""Choosing the one physical layout every rank uses (reference §2.4).

Each rank's attention backend declares the layouts it can serve, most preferred first. Ranks
must agree; a requested layout wins if every rank supports it and it can express the specs;
otherwise the first candidate is used. Every refusal names the layout and lists valid ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcore.errors import KVCacheLayoutError
from kvcore.layout import KVCacheLayout
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import iter_layer_specs

# The order used when no backend declares anything: LBNHC first, matching the historical NHD.
DEFAULT_LAYOUT_PREFERENCE: tuple[KVCacheLayout, ...] = (
    KVCacheLayout.LBNHC,
    KVCacheLayout.LBHNC,
    KVCacheLayout.BLNHC,
    KVCacheLayout.BLHNC,
    KVCacheLayout.BHLNC,
    KVCacheLayout.LHBNC,
)


def _names(layouts: Iterable[KVCacheLayout]) -> list[str]:
    return [layout.name for layout in layouts]


def get_supported_kv_cache_layouts(
    declarations: Sequence[Sequence[KVCacheLayout | str] | None],
) -> list[KVCacheLayout]:
    """Combine the declarations of one rank's backends (None = any layout, no preference).

    Identical declarations keep their order; otherwise the intersection is ordered by how many
    backends list a layout first, ties in enum order.
    """
    declared = [[KVCacheLayout.parse(n) for n in d] for d in declarations if d is not None]
    if not declared:
        return list(DEFAULT_LAYOUT_PREFERENCE)
    if all(d == declared[0] for d in declared):
        return declared[0]
    common = set(declared[0]).intersection(*declared[1:])
    if not common:
        raise KVCacheLayoutError(
            f"No KV cache layout satisfies every supported set: {[_names(d) for d in declared]}."
        )
    first_votes = {layout: sum(d[0] is layout for d in declared) for layout in common}
    enum_order = list(KVCacheLayout)
    return sorted(common, key=lambda layout: (-first_votes[layout], enum_order.index(layout)))


def has_mixed_hnc_shapes(specs: Iterable[KVCacheSpec]) -> bool:
    """More than one ``(H, N, page)`` shape among the per-layer specs."""
    shapes = {
        (spec.num_heads, spec.num_states, spec.page_size_bytes)
        for group_spec in specs
        for spec in iter_layer_specs(group_spec)
    }
    return len(shapes) > 1


def resolve_kv_cache_layout(
    requested: KVCacheLayout | str | None,
    supported_per_rank: Sequence[Sequence[KVCacheLayout | str]],
    specs: Iterable[KVCacheSpec],
) -> KVCacheLayout:
    """The layout for this model: ``requested`` if possible, else the ranks' first choice."""
    if not supported_per_rank or any(len(s) == 0 for s in supported_per_rank):
        raise KVCacheLayoutError("No worker reported supported KV cache layouts.")
    parsed = [[KVCacheLayout.parse(n) for n in s] for s in supported_per_rank]
    if any(s != parsed[0] for s in parsed):
        raise KVCacheLayoutError(
            f"Workers disagree on supported KV cache layouts: {[_names(s) for s in parsed]}"
        )
    candidates = parsed[0]
    if has_mixed_hnc_shapes(specs):
        candidates = [layout for layout in candidates if layout.is_block_compact]
        if not candidates:
            raise KVCacheLayoutError(
                "Specs with mixed HNC shapes need a block-compact layout, but none is in every "
                f"supported set: {_names(parsed[0])}. Block-compact layouts: "
                f"{_names(layout for layout in KVCacheLayout if layout.is_block_compact)}."
            )
    if requested is None:
        return candidates[0]
    layout = KVCacheLayout.parse(requested)
    if layout not in candidates:
        raise KVCacheLayoutError(
            f"The configured layout {layout.name} does not satisfy every supported set; "
            f"valid layouts: {_names(candidates)}"
        )
    return layout
