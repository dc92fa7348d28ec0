"""One KV-cache group whose layers have different specs of one family (and one block size).

Example: full-attention layers beside compressed MLA layers whose pages are smaller. The group's
block holds one page of every member, so its page size is the sum of the member pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Union

from kvcore._math import cdiv
from kvcore.attention_specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from kvcore.errors import KVCacheSpecError
from kvcore.mamba_spec import MambaSpec
from kvcore.spec_base import KVCacheSpec


class UniformTypeKVCacheSpecs(KVCacheSpec, frozen=True, kw_only=True):
    kv_cache_specs: dict[str, AnyKVCacheSpec]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kv_cache_specs:
            raise KVCacheSpecError("UniformTypeKVCacheSpecs needs at least one layer spec.")
        if not type(self).is_uniform_type(self.kv_cache_specs.values()):
            raise KVCacheSpecError(
                "UniformTypeKVCacheSpecs members must share one block size and one spec family."
            )
        if self.first_spec.block_size != self.block_size:
            raise KVCacheSpecError(
                f"UniformTypeKVCacheSpecs.block_size={self.block_size} differs from its "
                f"members' block size {self.first_spec.block_size}."
            )

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for spec in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_pages(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return max(
            cdiv(
                spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens),
                spec.page_size_bytes,
            )
            for spec in self.kv_cache_specs.values()
        )

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        pages = self.max_memory_usage_pages(max_model_len, max_num_batched_tokens)
        return pages * self.page_size_bytes

    def max_num_blocks_per_req(self, max_len: int) -> int:
        widths = [spec.max_num_blocks_per_req(max_len) for spec in self.kv_cache_specs.values()]
        if len(set(widths)) != 1:
            raise KVCacheSpecError(
                "All layers in the same KV cache group must need the same number of block "
                f"table entries, got {widths}"
            )
        return widths[0]

    def get_max_layers_per_page_size(self) -> int:
        """How often the most common page size appears (the pattern repeats, when balanced)."""
        counts = Counter(spec.page_size_bytes for spec in self.kv_cache_specs.values())
        return max(counts.values())

    @classmethod
    def is_uniform_type(cls, specs) -> bool:
        specs = list(specs)
        if not specs or len({spec.block_size for spec in specs}) > 1:
            return False
        return specs[0].is_uniform_with_collection(specs)

    @classmethod
    def from_specs(cls, specs: Mapping[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The wrapper over ``specs`` (layer name → spec), or None when they are not uniform."""
        if not cls.is_uniform_type(specs.values()):
            return None
        block_size = next(iter(specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(specs))


def iter_layer_specs(spec: KVCacheSpec) -> Sequence[KVCacheSpec]:
    """The per-layer specs behind ``spec``: the members of a wrapper, else the spec itself."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return tuple(spec.kv_cache_specs.values())
    return (spec,)


# Every concrete spec class, as the tagged union the wire format decodes into.
AnyKVCacheSpec = Union[  # noqa: UP007 (msgspec resolves this name lazily, as a runtime object)
    AttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SlidingWindowMLASpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
]
