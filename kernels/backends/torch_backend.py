"""The torch backend: the reference implementations, the fast path on CPUs. No triton."""

from __future__ import annotations

import torch

from kernels.backends.base import AttentionBackend
from kernels.metadata import AttentionMetadata
from kernels.params import AttentionParams
from kernels.reference import paged_attention_reference, write_kv_reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        write_kv_reference(key, value, kv_cache, metadata.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention_reference(query, kv_cache, metadata, params, out)
