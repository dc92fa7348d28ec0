"""``import kernels`` and the torch backend run without triton; nothing here imports ray."""

from __future__ import annotations

import subprocess
import sys


def test_torch_backend_runs_without_triton_or_ray():
    code = (
        "import sys, torch, kvcore, kernels\n"
        "spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,"
        " dtype='float32')\n"
        "tensor = kvcore.build_kv_cache_tensor(spec, ['l'], 2, 'BHLNC')\n"
        "raw = torch.zeros(tensor.size, dtype=torch.int8)\n"
        "view = kvcore.create_kv_cache_views(raw, spec, 2, 'BHLNC', tensor)['l']\n"
        "backend = kernels.get_attention_backend('torch')\n"
        "step = backend.build_metadata([3], [3], [[1]], 16)\n"
        "q, k, v = torch.ones(3, 2, 8), torch.ones(3, 1, 8), torch.ones(3, 1, 8)\n"
        "params = kernels.AttentionParams(scale=1.0, num_kv_heads=1)\n"
        "out = backend.forward(q, k, v, view, step, params)\n"
        "assert out.shape == (3, 2, 8) and bool((out == 1).all())\n"
        "heavy = [m for m in ('triton', 'ray') if m in sys.modules]\n"
        "print(','.join(heavy) or 'clean')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "clean"
