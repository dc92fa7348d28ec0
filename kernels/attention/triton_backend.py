"""The triton backend: the GPU path. On a CPU it runs only under the Triton interpreter.

Building the backend, shaping specs (``customize_spec``) and listing layouts need neither a
GPU nor triton itself: the controller plans with this backend on a node without GPUs, and
``kvray plan`` runs on laptops where triton is not even installed. The kernel modules (and
with them triton) load on the first launch, which is where a missing GPU is refused.
"""

from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.registry import check_can_launch


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        check_can_launch(kv_cache.device, "attention")
        from kernels.attention.cache_write import write_kv

        write_kv(key, value, kv_cache, metadata.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_can_launch(kv_cache.device, "attention")
        from kernels.attention.paged_attention import paged_attention

        return paged_attention(query, kv_cache, metadata, params, out)
