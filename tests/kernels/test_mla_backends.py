"""The MLA backend registry, and the torch backend's independence from triton."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernels.mla import MLABackend, UnknownMLABackendError, get_mla_backend, mla_backend_names


def test_registry():
    assert mla_backend_names() == ["torch", "triton"]
    for name in ("torch", " Triton "):
        backend = get_mla_backend(name)
        assert isinstance(backend, MLABackend) and backend.name == name.strip().lower()
    with pytest.raises(UnknownMLABackendError, match="Valid backends: \\['torch', 'triton'\\]"):
        get_mla_backend("flashmla")


def test_torch_backend_imports_no_triton():
    code = (
        "import sys, torch\n"
        "from kernels.mla import get_mla_backend\n"
        "b = get_mla_backend('torch')\n"
        "cache = torch.zeros(2, 1, 4, 6)\n"
        "b.write_latent(torch.ones(1, 4), torch.ones(1, 2), cache, torch.tensor([5]))\n"
        "table = torch.tensor([[1]], dtype=torch.int32)\n"
        "lens = torch.tensor([2], dtype=torch.int32)\n"
        "out = b.decode(torch.ones(1, 3, 4), torch.ones(1, 3, 2), cache, table, lens, 4, 1.0)\n"
        "assert out.shape == (1, 3, 4)\n"
        "get_mla_backend('triton')\n"
        "print('triton' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False"
