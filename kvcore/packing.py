"""The packed planner: groups for block-outermost layouts with mixed page sizes (§4.5).

Under a block-outermost layout one block id addresses one contiguous run of bytes holding a page
of every layer of a group, so groups with different page mixes can share one block width. The
planner buckets layers into uniform-type families, cuts balanced buckets (1:1:... page patterns)
into groups of a common number of pattern repeats, and spreads recurrent-state layers over as
many groups as it takes to fill the block width the other groups already force.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcore._math import cdiv
from kvcore.attention_specs import CircularBufferSpec, SlidingWindowSpec
from kvcore.errors import KVCacheSpecMergeError
from kvcore.kv_cache_config import KVCacheGroupSpec
from kvcore.layout import KVCacheLayout
from kvcore.mamba_spec import MambaSpec
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import UniformTypeKVCacheSpecs


def approximate_gcd(values: Sequence[int], lower_bound: int = 1) -> int:
    """The divisor in ``[max(1, lower_bound), max(values)]`` that needs the least padding to
    divide every value (ties go to the larger divisor); ``lower_bound`` if it exceeds them."""
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"approximate_gcd needs positive values, got {list(values)}")
    low = max(1, lower_bound)
    if low > max(values):
        return low
    best, best_padding = low, None
    for divisor in range(low, max(values) + 1):
        padding = sum((divisor - v % divisor) % divisor for v in values)
        if best_padding is None or padding <= best_padding:
            best, best_padding = divisor, padding
    return best


class _Bucket:
    """Layers of one uniform-type family, with their pages keyed by page size."""

    def __init__(self, layer_names: list[str], specs: Mapping[str, KVCacheSpec]) -> None:
        self.specs = {name: specs[name] for name in layer_names}
        self.page_map: dict[int, list[str]] = {}
        for name, spec in self.specs.items():
            self.page_map.setdefault(spec.page_size_bytes, []).append(name)
        counts = {len(names) for names in self.page_map.values()}
        self.is_balanced = len(counts) == 1
        self.max_layers_per_page = max(counts)

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.specs.values()))

    def is_state(self, repeats_per_group: int | None) -> bool:
        spec = self.first_spec
        if isinstance(spec, MambaSpec | CircularBufferSpec):
            return True
        return isinstance(spec, SlidingWindowSpec) and repeats_per_group is None

    def widest_group_bytes(self, num_groups: int) -> int:
        return sum(cdiv(len(n), num_groups) * page for page, n in self.page_map.items())

    def pattern_repeats(self) -> list[tuple[str, ...]]:
        """One tuple per repeat of the page pattern; layer by layer when unbalanced."""
        if self.is_balanced:
            return list(zip(*self.page_map.values(), strict=True))
        return [(name,) for name in self.specs]


def _bucket_layers(specs: Mapping[str, KVCacheSpec]) -> list[_Bucket]:
    buckets: list[list[str]] = []
    for name, spec in specs.items():
        for bucket in buckets:
            members = [specs[n] for n in bucket] + [spec]
            if UniformTypeKVCacheSpecs.is_uniform_type(members):
                bucket.append(name)
                break
        else:
            buckets.append([name])
    return [_Bucket(names, specs) for names in buckets]


def group_spec_for(specs: Mapping[str, KVCacheSpec]) -> KVCacheSpec:
    """The merged spec when the layers merge, else the uniform-type wrapper."""
    values = list(specs.values())
    try:
        return values[0].merge(values)
    except KVCacheSpecMergeError:
        wrapper = UniformTypeKVCacheSpecs.from_specs(specs)
        assert wrapper is not None, "packed buckets are uniform by construction"
        return wrapper


def get_packed_kv_cache_groups(
    specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout
) -> list[KVCacheGroupSpec] | None:
    """Groups for a block-outermost layout with mixed page sizes; None when that doesn't apply."""
    page_sizes = {spec.page_size_bytes for spec in specs.values()}
    if not layout.is_block_outermost or len(page_sizes) <= 1:
        return None
    buckets = _bucket_layers(specs)
    balanced = [b for b in buckets if b.is_balanced]
    # Balanced buckets with several page sizes must stay whole per repeat, so their repeat count
    # is the floor for the common one.
    min_repeats = max((b.max_layers_per_page for b in balanced if len(b.page_map) > 1), default=0)
    repeats = None
    if min_repeats > 0:
        repeats = approximate_gcd([b.max_layers_per_page for b in balanced], min_repeats)

    def num_groups_for(bucket: _Bucket) -> int:
        if bucket.is_balanced and repeats is not None:
            return cdiv(bucket.max_layers_per_page, repeats)
        return 1

    def anchor_groups(bucket: _Bucket) -> int:
        return len(bucket.specs) if bucket.is_state(repeats) else num_groups_for(bucket)

    anchor_bytes = max(b.widest_group_bytes(anchor_groups(b)) for b in buckets)
    groups: list[KVCacheGroupSpec] = []
    for bucket in buckets:
        num_groups = num_groups_for(bucket)
        if bucket.is_state(repeats) and anchor_bytes > 0:
            state_page = max(bucket.page_map)
            states_per_block = max(anchor_bytes // state_page, 1)
            num_groups = max(num_groups, cdiv(len(bucket.specs), states_per_block))
        groups.extend(_split_bucket(bucket, num_groups))
    return groups


def _split_bucket(bucket: _Bucket, num_groups: int) -> list[KVCacheGroupSpec]:
    if num_groups == 1:
        return [
            KVCacheGroupSpec(
                layer_names=list(bucket.specs), kv_cache_spec=group_spec_for(bucket.specs)
            )
        ]
    repeats = bucket.pattern_repeats()
    groups = []
    for index in range(num_groups):
        names = [name for repeat in repeats[index::num_groups] for name in repeat]
        if names:
            member_specs = {name: bucket.specs[name] for name in names}
            groups.append(
                KVCacheGroupSpec(layer_names=names, kv_cache_spec=group_spec_for(member_specs))
            )
    return groups
