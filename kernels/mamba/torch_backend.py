"""The torch Mamba backend: the references in ``conv1d_reference`` and ``ssd_reference``,
which are also the CPU serving path."""

from __future__ import annotations

from kernels.mamba.base import MambaBackend
from kernels.mamba.conv1d_reference import conv1d_decode_reference, conv1d_prefill_reference
from kernels.mamba.ssd_reference import ssd_decode_reference, ssd_prefill_reference


class TorchMambaBackend(MambaBackend):
    name = "torch"

    def conv1d_prefill(self, x, weight, bias, conv_state, state_indices, has_initial_state,
                       query_start_loc, checkpoints=None):  # fmt: skip
        return conv1d_prefill_reference(
            x, weight, bias, conv_state, state_indices, has_initial_state, query_start_loc,
            checkpoints,
        )  # fmt: skip

    def conv1d_decode(self, x, weight, bias, conv_state, state_indices):
        return conv1d_decode_reference(x, weight, bias, conv_state, state_indices)

    def ssd_prefill(self, x, dt, A, B, C, D, dt_bias, ssm_state, state_indices,
                    has_initial_state, query_start_loc, chunk_size, dt_min=0.0,
                    start_positions=None, checkpoints=None, *, chunks=None):  # fmt: skip
        return ssd_prefill_reference(
            x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, has_initial_state,
            query_start_loc, chunk_size, dt_min, start_positions, checkpoints, chunks=chunks,
        )  # fmt: skip

    def ssd_decode(self, x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, dt_min=0.0):
        return ssd_decode_reference(x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, dt_min)
