"""Planning for GPU workers from a process with no GPU: the controller's situation (its actor
reserves no GPU, and the head pod has none) and a laptop running ``kvray plan`` for a GPU
cluster. Neither CUDA, nor the Triton interpreter, nor triton itself is available there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as on a laptop without triton: importing it fails
    import torch
    assert not torch.cuda.is_available()

    from cluster.cli import main
    from cluster.config import EngineConfig
    from cluster.startup import plan_kv_cache
    from kernels import get_attention_backend
    from kvcore import RankReport, decode, encode
    from workers.model_source import DEFAULT_CONFIG
    from workers.kv_specs import rank_kv_cache_specs

    assert main(["plan", "--attention-backend", "triton", "--kv-cache-memory", "64MiB"]) == 0

    # The handshake: two GPU ranks report their specs; the controller checks and plans.
    backend = get_attention_backend("triton")
    layouts = [layout.name for layout in backend.supported_kv_cache_layouts()]
    replies = [
        encode(RankReport(
            rank=rank,
            specs=rank_kv_cache_specs(DEFAULT_CONFIG, 16, 2, rank, backend.customize_spec),
            supported_layouts=layouts,
            free_memory_bytes=64 << 20,
        ))
        for rank in range(2)
    ]
    config = EngineConfig(attention_backend="triton", tensor_parallel_size=2,
                          kv_cache_layout="BLHNC")
    plan = plan_kv_cache([decode(r, RankReport) for r in replies], DEFAULT_CONFIG, config)
    print("handshake", plan.layout, plan.num_blocks)
    print("triton imported:", sys.modules.get("triton") is not None)
    """
)


def test_plan_and_handshake_with_the_triton_backend_need_no_gpu_and_no_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("model: embedded:tiny (LlamaForCausalLM), TP 1")
    assert any(line.startswith("fits: ") for line in lines)
    handshake = [line for line in lines if line.startswith("handshake ")]
    assert handshake and handshake[0].split()[1] == "BLHNC" and int(handshake[0].split()[2]) > 1
    assert lines[-1] == "triton imported: False"
