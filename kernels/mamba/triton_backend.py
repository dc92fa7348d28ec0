"""The triton Mamba backend: the GPU path. On a CPU it runs only under the Triton interpreter.

Building the backend needs no triton; the kernel modules load on the first call, which is
where a missing GPU is refused.
"""

from __future__ import annotations

from kernels.mamba.base import MambaBackend
from kernels.registry import check_can_launch


class TritonMambaBackend(MambaBackend):
    name = "triton"

    def conv1d_prefill(self, x, conv, conv_state, batch):
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_conv1d import conv1d_prefill

        return conv1d_prefill(x, conv, conv_state, batch)

    def conv1d_decode(self, x, conv, conv_state, state_indices):
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_conv1d import conv1d_decode

        return conv1d_decode(x, conv, conv_state, state_indices)

    def ssd_prefill(self, x, dt, B, C, params, ssm_state, batch):
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_ssd import ssd_prefill

        return ssd_prefill(x, dt, B, C, params, ssm_state, batch)

    def ssd_decode(self, x, dt, B, C, params, ssm_state, state_indices):
        check_can_launch(x.device, "Mamba")
        from kernels.mamba.triton_state_update import ssd_decode

        return ssd_decode(x, dt, B, C, params, ssm_state, state_indices)
