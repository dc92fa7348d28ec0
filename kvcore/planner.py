"""The planner: per-layer specs and a memory budget in, one ``KVCacheConfig`` out (§4.7, §4.9).

Every group's tensors overlay one backing allocation of ``num_blocks * bytes_per_block`` bytes;
that is safe because a block id belongs to one group at a time. Under block-outermost layouts a
block is one run of ``bytes_per_block`` bytes packing a page of each of a group's layers; under
layer-outermost layouts each layer owns one region.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcore._math import cdiv
from kvcore.block_sizes import resolve_kv_cache_block_sizes
from kvcore.errors import KVCacheLayoutError, KVCacheSpecError
from kvcore.geometry import KVCacheTensor, build_kv_cache_tensor
from kvcore.grouping import get_kv_cache_groups
from kvcore.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvcore.layout import KVCacheLayout, valid_layout_names
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import UniformTypeKVCacheSpecs, iter_layer_specs

GiB = 1 << 30


class InsufficientKVCacheMemoryError(KVCacheSpecError):
    """The budget cannot hold the KV cache of one request at ``max_model_len``."""


def validate_kv_cache_layout(layout: KVCacheLayout, groups: Sequence[KVCacheGroupSpec]) -> None:
    """Mixed page sizes need a block-compact layout, and with several groups one that is not
    layer-compact (layers of different groups cannot each own a region of one width)."""
    pages = sorted({s.page_size_bytes for g in groups for s in iter_layer_specs(g.kv_cache_spec)})
    if len(pages) <= 1:
        return
    if layout.is_block_compact and not (layout.is_layer_compact and len(groups) > 1):
        return
    raise KVCacheLayoutError(
        f"KV cache layout {layout.name} cannot express this model's mixed page sizes ({pages}); "
        "a backend should declare block-outermost supported layouts (e.g. BLHNC), or set the "
        f"configured layout to BLHNC. Valid layouts: {valid_layout_names()}"
    )


def bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id reserves: the widest group's pages, one per layer."""
    return max(_group_block_bytes(g) for g in groups)


def _group_block_bytes(group: KVCacheGroupSpec) -> int:
    return sum(group.layer_spec(name).page_size_bytes for name in group.layer_names)


def build_kv_cache_tensors(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, layout: KVCacheLayout
) -> list[KVCacheTensor]:
    """One tensor per (group, distinct per-layer spec); every group starts at byte 0."""
    block_bytes = bytes_per_block(groups)
    interleaved = block_bytes if layout.is_block_outermost else None
    size = block_bytes * num_blocks
    tensors = []
    for group in groups:
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(group.layer_spec(name), []).append(name)
        byte_offset = 0  # bytes of one block taken by the specs before this one
        for spec, names in by_spec.items():
            page = spec.page_size_bytes
            tensor = build_kv_cache_tensor(
                spec, names, num_blocks, layout, block_stride=interleaved, size=size
            )
            # Layer-outer layouts scale the in-block offset by the block count.
            tensor.offset = byte_offset * max(tensor.layer_stride, page) // page
            tensors.append(tensor)
            byte_offset += len(names) * page
    return tensors


def pages_needed_per_request(
    group: KVCacheGroupSpec, max_model_len: int, max_num_batched_tokens: int
) -> int:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.max_memory_usage_pages(max_model_len, max_num_batched_tokens)
    need = spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
    return cdiv(need, spec.page_size_bytes)


def blocks_needed_per_request(
    groups: Sequence[KVCacheGroupSpec], max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Block ids one request can hold at once: every group claims its own from the pool."""
    return sum(pages_needed_per_request(g, max_model_len, max_num_batched_tokens) for g in groups)


def max_len_that_fits(
    groups: Sequence[KVCacheGroupSpec], budget: int, max_model_len: int, max_batched: int
) -> int:
    """Largest length in ``[0, max_model_len]`` whose one-request need fits ``budget`` bytes."""
    block_bytes = bytes_per_block(groups)
    low, high = 0, max_model_len
    while low < high:
        mid = (low + high + 1) // 2
        if blocks_needed_per_request(groups, mid, max_batched) * block_bytes <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def check_enough_memory(
    groups: Sequence[KVCacheGroupSpec], available: int, max_model_len: int, max_batched: int
) -> None:
    """Refuse when one request at ``max_model_len`` doesn't fit beside the null block."""
    block_bytes = bytes_per_block(groups)
    budget = available - block_bytes  # block 0 is the null block
    if budget <= 0:
        raise InsufficientKVCacheMemoryError(
            f"No available memory for the cache blocks: {available} bytes hold no block of "
            f"{block_bytes} bytes beyond the null block. Give the KV cache more memory "
            "(--gpu-memory-utilization on GPUs, --kv-cache-memory on CPU)."
        )
    needed = blocks_needed_per_request(groups, max_model_len, max_batched) * block_bytes
    if needed > budget:
        fits = max_len_that_fits(groups, budget, max_model_len, max_batched)
        raise InsufficientKVCacheMemoryError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{needed / GiB:.3f} GiB ({needed} bytes) of KV cache is needed, which is larger "
            f"than the available KV cache memory ({budget / GiB:.3f} GiB, {budget} bytes). "
            f"Based on the available memory, the estimated maximum model length is {fits}. "
            "Give the KV cache more memory or decrease --max-model-len."
        )


def get_kv_cache_config_from_groups(
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    layout: KVCacheLayout | str,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool = True,
    num_blocks_override: int | None = None,
) -> KVCacheConfig:
    layout = KVCacheLayout.parse(layout)
    groups = list(groups)
    sizes = resolve_kv_cache_block_sizes(groups, enable_prefix_caching=enable_prefix_caching)
    common = dict(
        layout=layout.name,
        scheduler_block_size=sizes.scheduler_block_size,
        hash_block_size=sizes.hash_block_size,
        cache_hit_alignment=sizes.cache_hit_alignment,
        max_model_len=max_model_len,
    )
    if not groups:  # attention-free: the pool still needs its null block
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[], **common)
    validate_kv_cache_layout(layout, groups)
    block_bytes = bytes_per_block(groups)
    num_blocks = available_memory // block_bytes
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    blocks_per_request = blocks_needed_per_request(groups, max_model_len, max_num_batched_tokens)
    concurrency = num_blocks / blocks_per_request
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=build_kv_cache_tensors(groups, num_blocks, layout),
        kv_cache_groups=groups,
        capacity_tokens=int(concurrency * max_model_len),
        max_concurrency=concurrency,
        **common,
    )


def get_kv_cache_config(
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    layout: KVCacheLayout | str,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool = True,
    num_blocks_override: int | None = None,
) -> KVCacheConfig:
    """Plan one rank's cache. ``specs`` maps layer name -> spec in layer order;
    ``available_memory`` is the bytes this rank gives the cache."""
    groups = get_kv_cache_groups(specs, layout)
    if groups:
        budget = available_memory
        if num_blocks_override is not None:
            budget = num_blocks_override * bytes_per_block(groups)
        check_enough_memory(groups, budget, max_model_len, max_num_batched_tokens)
    return get_kv_cache_config_from_groups(
        groups,
        available_memory,
        layout,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        num_blocks_override=num_blocks_override,
    )


def get_kv_cache_configs(
    specs_per_rank: Sequence[Mapping[str, KVCacheSpec]],
    available_memory_per_rank: Sequence[int],
    layout: KVCacheLayout | str,
    **options,
) -> list[KVCacheConfig]:
    """Plan every rank. Ranks hold the same layers with the same specs (checked), so each rank
    is planned with the smallest rank's memory: identical tensors and ``num_blocks`` on all."""
    if len(specs_per_rank) != len(available_memory_per_rank) or not specs_per_rank:
        raise ValueError("Need one spec map and one memory figure per rank.")
    first = specs_per_rank[0]
    for rank, specs in enumerate(specs_per_rank):
        if list(specs.items()) != list(first.items()):
            raise KVCacheSpecError(
                f"The KV cache specs of rank {rank} differ from rank 0's; every tensor-parallel "
                "rank must report the same layers with the same specs."
            )
    config = get_kv_cache_config(first, min(available_memory_per_rank), layout, **options)
    return [config] * len(specs_per_rank)
