"""``import kvcore`` must not pull in torch: the controller and the client don't need it."""

from __future__ import annotations

import subprocess
import sys


def run_fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return result.stdout.strip()


def test_import_kvcore_leaves_torch_out():
    code = (
        "import sys, kvcore\n"
        "spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,"
        " dtype='bfloat16')\n"
        "kvcore.compute_layout_strides(spec, 10, 2, 'BLHNC')\n"
        "kvcore.decode_spec(kvcore.encode(spec))\n"
        "heavy = [m for m in ('torch', 'triton', 'ray', 'grpc') if m in sys.modules]\n"
        "print(','.join(heavy) or 'clean')"
    )
    assert run_fresh(code) == "clean"


def test_view_functions_load_torch_on_first_use():
    code = (
        "import sys, kvcore\n"
        "before = 'torch' in sys.modules\n"
        "kvcore.create_kv_cache_views\n"
        "print(before, 'torch' in sys.modules)"
    )
    assert run_fresh(code) == "False True"
