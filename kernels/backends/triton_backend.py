"""The triton backend: the GPU path. On a CPU it runs only under the Triton interpreter."""

from __future__ import annotations

import torch

from kernels.backends.base import AttentionBackend
from kernels.cache_write import write_kv
from kernels.metadata import AttentionMetadata
from kernels.paged_attention import is_interpreted, paged_attention
from kernels.params import AttentionParams


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        if not (torch.cuda.is_available() or is_interpreted()):
            raise RuntimeError(
                "The triton attention backend needs a CUDA GPU, or TRITON_INTERPRET=1 set "
                "before triton is first imported. Use the torch backend on CPU-only machines."
            )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        write_kv(key, value, kv_cache, metadata.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention(query, kv_cache, metadata, params, out)
