"""The torch Mamba backend: the references in ``conv1d_reference`` and ``ssd_reference``,
which are also the CPU serving path."""

from __future__ import annotations

from kernels.mamba.base import MambaBackend
from kernels.mamba.conv1d_reference import conv1d_decode_reference, conv1d_prefill_reference
from kernels.mamba.ssd_reference import ssd_decode_reference, ssd_prefill_reference


class TorchMambaBackend(MambaBackend):
    name = "torch"

    def conv1d_prefill(self, x, conv, conv_state, batch):
        return conv1d_prefill_reference(x, conv, conv_state, batch)

    def conv1d_decode(self, x, conv, conv_state, state_indices):
        return conv1d_decode_reference(x, conv, conv_state, state_indices)

    def ssd_prefill(self, x, dt, B, C, params, ssm_state, batch):
        return ssd_prefill_reference(x, dt, B, C, params, ssm_state, batch)

    def ssd_decode(self, x, dt, B, C, params, ssm_state, state_indices):
        return ssd_decode_reference(x, dt, B, C, params, ssm_state, state_indices)
