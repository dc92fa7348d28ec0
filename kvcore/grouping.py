"""Turning per-layer specs into KV-cache groups (reference §4.3-§4.4).

A group is a set of layers that share one block table. The decision tree: one group when every
spec merges; one uniform-type group when they are one family with one block size; the packed
planner for block-outermost layouts with mixed pages; otherwise make every page the same size
(scale the block size, or pad) and cut the layers into equal-sized groups.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec

from kvcore._math import cdiv
from kvcore.attention_specs import AttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec
from kvcore.errors import KVCacheSpecError, KVCacheSpecMergeError
from kvcore.kv_cache_config import KVCacheGroupSpec
from kvcore.layout import KVCacheLayout
from kvcore.mamba_spec import MambaSpec
from kvcore.packing import get_packed_kv_cache_groups
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import UniformTypeKVCacheSpecs

logger = logging.getLogger(__name__)


def try_merge(specs: list[KVCacheSpec]) -> KVCacheSpec | None:
    """The merged spec of ``specs``, or None when they cannot share one group spec."""
    try:
        return specs[0].merge(specs)
    except KVCacheSpecMergeError:
        return None


def get_kv_cache_groups(
    specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout | str
) -> list[KVCacheGroupSpec]:
    """Groups for ``specs`` (layer name -> per-layer spec, in layer order) under ``layout``."""
    layout = KVCacheLayout.parse(layout)
    if not specs:
        return []
    merged = try_merge(list(specs.values()))
    if merged is not None:
        return [KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=merged)]
    wrapper = UniformTypeKVCacheSpecs.from_specs(specs)
    if wrapper is not None:
        return [KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=wrapper)]
    packed = get_packed_kv_cache_groups(specs, layout)
    if packed is not None:
        return packed
    return group_uniform_page_size(unify_kv_cache_spec_page_size(specs))


def unify_kv_cache_spec_page_size(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Make every page as large as the largest: scale the block size when the page divides it,
    otherwise pad the page (recurrent states and non-MLA attention only)."""
    max_page = max(spec.page_size_bytes for spec in specs.values())
    unified = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if page == max_page:
            new_spec = spec
        elif isinstance(spec, MambaSpec):
            new_spec = msgspec.structs.replace(spec, page_size_padded=max_page)
        elif max_page % page == 0:
            new_spec = spec.copy_with_new_block_size(spec.block_size * (max_page // page))
        elif isinstance(spec, AttentionSpec) and not isinstance(
            spec, MLAAttentionSpec | SlidingWindowMLASpec
        ):
            new_spec = msgspec.structs.replace(spec, page_size_padded=max_page)
        else:
            raise KVCacheSpecError(
                f"Layer {name}: page size {page} is not divisible by the maximum page size "
                f"{max_page} and cannot be padded. Padding is only supported for non-MLA "
                "attention layers."
            )
        if new_spec.page_size_bytes != max_page:
            raise KVCacheSpecError(
                f"Layer {name}: could not bring its {page}-byte page to {max_page} bytes."
            )
        unified[name] = new_spec
    return unified


def group_uniform_page_size(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Cut layers with one page size into groups of equal size (pad short groups).

    Layers are bucketed by spec (buckets whose specs merge are joined); each bucket is cut into
    groups of ``group_size`` layers by strided assignment, which keeps pipeline stages balanced.
    """
    buckets: list[list[str]] = []
    for name, spec in specs.items():
        for bucket in buckets:
            if try_merge([specs[n] for n in bucket] + [spec]) is not None:
                bucket.append(name)
                break
        else:
            buckets.append([name])
    lengths = [len(bucket) for bucket in buckets]
    min_len, max_len = min(lengths), max(lengths)
    # One group size for all buckets; the larger one when it wastes less than half a group.
    group_size = max_len if max_len < 1.5 * min_len else min_len
    groups = []
    for bucket in buckets:
        padding = -len(bucket) % group_size
        if padding:
            logger.warning(
                "Add %d padding layers, may waste at most %.2f%% KV cache memory",
                padding,
                100 * padding / (len(specs) + padding),
            )
        num_groups = cdiv(len(bucket), group_size)
        for index in range(num_groups):
            names = bucket[index::num_groups]
            layer_specs = [specs[n] for n in names]
            groups.append(
                KVCacheGroupSpec(layer_names=names, kv_cache_spec=layer_specs[0].merge(layer_specs))
            )
    return groups
