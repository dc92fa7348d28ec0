"""The Mamba backend registry, and the torch reference against the Triton kernels on a geometry
that tiles: chunks of 64 and 128 positions (several row and column tiles per chunk), a head
dim of 80 and a state of 96 (two tiles each, the second partial), prompts of several chunks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels.mamba import (
    MambaBackend,
    UnknownMambaBackendError,
    get_mamba_backend,
    mamba_backend_names,
)
from tests.kernels.test_mamba_conv1d import make_batch as make_conv_batch
from tests.kernels.test_mamba_ssd import (
    NUM_SLOTS,
    assert_close,
    expected_prefill,
    make_batch,
)

pytestmark = pytest.mark.usefixtures("poison_new_outputs")


def test_registry():
    assert mamba_backend_names() == ["torch", "triton"]
    for name in ("torch", " Triton "):
        backend = get_mamba_backend(name)
        assert isinstance(backend, MambaBackend) and backend.name == name.strip().lower()
    with pytest.raises(UnknownMambaBackendError, match="Valid backends: \\['torch', 'triton'\\]"):
        get_mamba_backend("cuda")


def test_torch_backend_imports_no_triton():
    code = (
        "import sys, torch\n"
        "from kernels.mamba import get_mamba_backend\n"
        "b = get_mamba_backend('torch')\n"
        "x, w, s = torch.ones(3, 4), torch.ones(4, 4), torch.zeros(2, 3, 4)\n"
        "qsl, idx = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)\n"
        "from kernels.mamba import ConvWeights, VarlenBatch\n"
        "batch = VarlenBatch(idx, torch.tensor([False]), qsl)\n"
        "b.conv1d_prefill(x, ConvWeights(w, None), s, batch)\n"
        "get_mamba_backend('triton')\n"
        "print('triton' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_ssd_prefill_torch_matches_triton_on_tiled_geometry(chunk_size):
    lens, starts = [150, 7, 70], [100, 0, 60]
    batch = make_batch(lens, [True, False, True], starts, chunk_size=chunk_size, num_groups=2,
                       num_heads=2, head_dim=80, state_size=96, seed=5)  # fmt: skip
    expected_y, expected_states = expected_prefill(batch)
    results = {}
    for name in ("torch", "triton"):
        state = batch.ssm_state.clone()
        y = get_mamba_backend(name).ssd_prefill(
            batch.x, batch.dt, batch.B, batch.C, batch.params(), state, batch.varlen(chunk_size)
        )
        assert_close(y, expected_y, torch.float32)
        for slot, value in expected_states.items():
            assert_close(state[slot], value, torch.float32)
        results[name] = y, state
    assert batch.checkpoints.shape[0] >= 3 and len(expected_states) < NUM_SLOTS
    torch.testing.assert_close(results["torch"][0], results["triton"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["torch"][1], results["triton"][1], rtol=1e-4, atol=1e-4)


def test_conv1d_torch_matches_triton_on_wide_channels():
    # 200 channels span four 64-channel blocks; 40 tokens span three 16-token tiles.
    batch = make_conv_batch([40, 3, 17], [True, True, False], dim=200, checkpoints=[(0, 33, 11)])
    results = []
    for name in ("torch", "triton"):
        state = batch.conv_state.clone()
        out = get_mamba_backend(name).conv1d_prefill(batch.x, batch.conv(), state, batch.varlen())
        results.append((out, state))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-4)
