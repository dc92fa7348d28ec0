"""The triton MLA backend: the GPU path. On a CPU it runs only under the Triton interpreter.

Building the backend needs no triton; the kernel modules load on the first call, which is
where a missing GPU is refused.
"""

from __future__ import annotations

from kernels.mla.base import DEFAULT_NUM_SPLITS, MLABackend
from kernels.registry import check_can_launch


class TritonMLABackend(MLABackend):
    name = "triton"

    def write_latent(self, kv_c, k_pe, kv_cache, slot_mapping):
        check_can_launch(kv_c.device, "MLA")
        from kernels.mla.triton_write import write_latent

        write_latent(kv_c, k_pe, kv_cache, slot_mapping)

    def decode(self, q_latent, q_pe, kv_cache, block_table, seq_lens, block_size, scale,
               num_splits=DEFAULT_NUM_SPLITS, out=None):  # fmt: skip
        check_can_launch(q_latent.device, "MLA")
        from kernels.mla.triton_decode import mla_decode

        return mla_decode(
            q_latent, q_pe, kv_cache, block_table, seq_lens, block_size, scale, num_splits, out
        )
