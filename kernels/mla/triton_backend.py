"""The triton MLA backend: the GPU path. On a CPU it runs only under the Triton interpreter.

Building the backend needs no triton; the kernel modules load on the first call, which is
where a missing GPU is refused.
"""

from __future__ import annotations

import torch

from kernels.mla.base import DEFAULT_NUM_SPLITS, MLABackend


class TritonMLABackend(MLABackend):
    name = "triton"

    def write_latent(self, kv_c, k_pe, kv_cache, slot_mapping):
        check_can_launch(kv_c.device)
        from kernels.mla.triton_write import write_latent

        write_latent(kv_c, k_pe, kv_cache, slot_mapping)

    def decode(self, q_latent, q_pe, kv_cache, block_table, seq_lens, block_size, scale,
               num_splits=DEFAULT_NUM_SPLITS, out=None):  # fmt: skip
        check_can_launch(q_latent.device)
        from kernels.mla.triton_decode import mla_decode

        return mla_decode(
            q_latent, q_pe, kv_cache, block_table, seq_lens, block_size, scale, num_splits, out
        )


def check_can_launch(device: torch.device) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if device.type == "cuda":
        return
    from kernels.paged_attention import is_interpreted

    if not is_interpreted():
        raise RuntimeError(
            f"The triton MLA backend cannot run on {device.type} tensors: it needs a CUDA "
            "GPU, or TRITON_INTERPRET=1 set before triton is first imported. Use the torch "
            "backend on CPU-only workers."
        )
