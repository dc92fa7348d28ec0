"""SiLU(gate) * up in one C pass (``kernels.activation.gated`` on CPUs, the glue form's
``gated_silu`` in decode steps): torch's values within a few units of the last place, over
widths that leave a tail past the sixteen lanes, and the far ends of the exponential; torch
for what the kernel does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import activate, gated
from kernels.decoder.cpu_decoder import decoder_library, gated_silu

pytestmark = pytest.mark.skipif(decoder_library() is None, reason="no C compiler here")


def by_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("shape", [(1, 2 * 1408), (7, 2 * 37), (3, 5, 2 * 64), (2048, 2 * 16)])
def test_the_kernel_matches_torch(shape):
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 6
    fused = gated_silu(gate_up)
    assert fused is not None and fused.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(fused, by_torch(gate_up), rtol=2e-6, atol=1e-6)


def test_the_far_ends_of_the_exponential():
    gate = torch.tensor([-1e4, -200.0, -103.5, -88.8, -20.0, -1e-7, 0.0, 1e-7, 20.0, 88.8, 200.0])
    up = torch.linspace(-3, 3, gate.numel())
    gate_up = torch.cat([gate, up]).repeat(2, 1)
    fused = gated_silu(gate_up)
    torch.testing.assert_close(fused, by_torch(gate_up), rtol=2e-6, atol=1e-30)
    assert torch.isfinite(fused).all()


def test_what_the_kernel_does_not_take_goes_through_torch():
    gate_up = torch.randn(4, 2 * 24)
    assert gated_silu(gate_up.to(torch.bfloat16)) is None
    assert gated_silu(gate_up[:, ::2]) is None  # strided
    assert gated_silu(torch.randn(4, 7)) is None  # no even split
    for activation in ("silu", "relu2"):
        for x in (gate_up, gate_up.to(torch.bfloat16), gate_up.t().contiguous().t()):
            gate, up = x.chunk(2, dim=-1)
            torch.testing.assert_close(
                gated(x, activation), activate(gate, activation) * up, rtol=2e-6, atol=1e-6
            )
