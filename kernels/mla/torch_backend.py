"""The torch MLA backend: the references in ``kernels.mla.reference``, which are also the CPU
serving path."""

from __future__ import annotations

from kernels.mla.base import DEFAULT_NUM_SPLITS, MLABackend
from kernels.mla.reference import mla_decode_reference, write_latent_reference


class TorchMLABackend(MLABackend):
    name = "torch"

    def write_latent(self, kv_c, k_pe, kv_cache, slot_mapping):
        write_latent_reference(kv_c, k_pe, kv_cache, slot_mapping)

    def decode(self, q_latent, q_pe, kv_cache, block_table, seq_lens, block_size, scale,
               num_splits=DEFAULT_NUM_SPLITS, out=None):  # fmt: skip
        return mla_decode_reference(
            q_latent, q_pe, kv_cache, block_table, seq_lens, block_size, scale, num_splits, out
        )
