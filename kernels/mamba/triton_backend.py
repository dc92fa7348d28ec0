"""The triton Mamba backend: the GPU path. On a CPU it runs only under the Triton interpreter.

Building the backend needs no triton; the kernel modules load on the first call, which is
where a missing GPU is refused.
"""

from __future__ import annotations

from kernels.mamba.base import MambaBackend
from kernels.registry import check_can_launch


class TritonMambaBackend(MambaBackend):
    name = "triton"

    def conv1d_prefill(self, x, weight, bias, conv_state, state_indices, has_initial_state,
                       query_start_loc, checkpoints=None):  # fmt: skip
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_conv1d import conv1d_prefill

        return conv1d_prefill(
            x, weight, bias, conv_state, state_indices, has_initial_state, query_start_loc,
            checkpoints,
        )  # fmt: skip

    def conv1d_decode(self, x, weight, bias, conv_state, state_indices):
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_conv1d import conv1d_decode

        return conv1d_decode(x, weight, bias, conv_state, state_indices)

    def ssd_prefill(self, x, dt, A, B, C, D, dt_bias, ssm_state, state_indices,
                    has_initial_state, query_start_loc, chunk_size, dt_min=0.0,
                    start_positions=None, checkpoints=None, *, chunks=None):  # fmt: skip
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_ssd import ssd_prefill

        return ssd_prefill(
            x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, has_initial_state,
            query_start_loc, chunk_size, dt_min, start_positions, checkpoints, chunks=chunks,
        )  # fmt: skip

    def ssd_decode(self, x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, dt_min=0.0):
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_state_update import ssd_decode

        return ssd_decode(x, dt, A, B, C, D, dt_bias, ssm_state, state_indices, dt_min)
