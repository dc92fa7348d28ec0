"""The attention backend interface the workers program against.

A worker picks one backend by name, lets it shape the layer specs (``customize_spec``) before
they travel to the controller, checks the resolved layout and kernel block size against it,
builds metadata once per step and calls ``forward`` once per attention layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch

from kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from kernels.attention.params import AttentionParams
from kvcore import AttentionSpec, KVCacheLayout, KVCacheLayoutError, KVCacheSpec


class UnknownAttentionBackendError(ValueError):
    """A backend name that is not registered."""


class UnsupportedKVCacheError(ValueError):
    """A kernel block size or cache dtype the chosen backend cannot serve."""


class MultipleOf(NamedTuple):
    """A supported kernel block size family: every positive multiple of ``base``."""

    base: int


class AttentionBackend(ABC):
    """One way of running paged attention. Stateless: safe to share across layers."""

    name: ClassVar[str]
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16", "float32")
    # Whether a decode step can be captured in a CUDA graph: its kernels read every per-step
    # value from device tensors, never from the metadata's host copies.
    supports_cuda_graphs: ClassVar[bool] = False

    def supported_kv_cache_layouts(self) -> tuple[KVCacheLayout, ...]:
        """Every layout: the kernels read the cache only through the views' strides."""
        return tuple(KVCacheLayout)

    def supported_kernel_block_sizes(self) -> tuple[int | MultipleOf, ...]:
        return (MultipleOf(1),)

    def check_kv_cache_layout(self, layout: str | KVCacheLayout) -> KVCacheLayout:
        """The parsed layout, or a ``KVCacheLayoutError`` naming this backend's layouts."""
        layout = KVCacheLayout.parse(layout)
        supported = self.supported_kv_cache_layouts()
        if layout not in supported:
            raise KVCacheLayoutError(
                f"The {self.name} attention backend does not support KV cache layout "
                f"{layout.name}. Supported layouts: {[item.name for item in supported]}"
            )
        return layout

    def check_kernel_block_size(self, kernel_block_size: int) -> int:
        for allowed in self.supported_kernel_block_sizes():
            if isinstance(allowed, MultipleOf):
                if kernel_block_size > 0 and kernel_block_size % allowed.base == 0:
                    return kernel_block_size
            elif kernel_block_size == allowed:
                return kernel_block_size
        raise UnsupportedKVCacheError(
            f"The {self.name} attention backend does not support kernel block size "
            f"{kernel_block_size}. Supported: {list(self.supported_kernel_block_sizes())}"
        )

    def customize_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """Publish backend geometry (``num_head_slots``, ``state_content_bytes``, padding) on a
        layer's spec before it leaves the worker. Refuses attention cache dtypes it cannot
        read; other specs (recurrent state) pass through untouched."""
        if isinstance(spec, AttentionSpec) and spec.dtype not in self.kv_cache_dtypes:
            raise UnsupportedKVCacheError(
                f"The {self.name} attention backend does not support KV cache dtype "
                f"{spec.dtype!r}. Supported: {list(self.kv_cache_dtypes)}"
            )
        return spec

    def build_metadata(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_tokens: int | None = None,
    ) -> AttentionMetadata:
        """Once per step, shared by every layer; see ``kernels.attention.metadata``."""
        return build_attention_metadata(
            query_lens, seq_lens, block_tables, block_size, device, num_tokens
        )

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store the step's K ``[T, Hkv, D]`` and V ``[T, Hkv, Dv]`` at its slot mapping."""

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal paged attention, ``[T, Hq, D]`` -> ``[T, Hq, Dv]``."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's step: write the new K/V (if given), then attend over the whole cache."""
        if key is not None and value is not None:
            self.write_kv(key, value, kv_cache, metadata)
        return self.attend(query, kv_cache, metadata, params, out)
