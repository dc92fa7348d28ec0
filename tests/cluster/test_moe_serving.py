"""A mixture-of-experts checkpoint served through the Ray controller at TP 2, its experts split
by their intermediate dimension and, with --enable-expert-parallel, whole experts per rank:
both give transformers' greedy tokens, and each rank holds the experts the handshake checked."""

from __future__ import annotations

import pytest
import ray

from cluster.client import Client
from kvcore import decode
from tests.cluster.ray_helpers import serve, stop
from tests.workers.hf_models import PROMPTS, reference_generations, save_model
from workers.expert_placement import ExpertReport
from workers.model_config import ExpertShard


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A Qwen2-MoE (dense and MoE layers, a gated shared expert) and its reference tokens."""
    directory = save_model("qwen2-moe", tmp_path_factory.mktemp("qwen2-moe"))
    return directory, reference_generations(directory, PROMPTS, 12)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_serves_transformers_tokens(local_ray, qwen2_moe, expert_parallel):
    directory, expected = qwen2_moe
    handle, address = serve(
        model=str(directory),
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        block_size=4,
    )
    try:
        with Client(address, timeout=120) as client:
            tokens = [client.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS]
        assert tokens == expected
        workers = ray.get(handle.worker_handles.remote())
        held = [ray.get(w.report_shards.remote()) for w in workers]
        layer = "model.layers.1.mlp.experts"  # decoder_sparse_step 2: layers 1 and 3
        if expert_parallel:
            shards = [ExpertShard(0, 2, 0, 32), ExpertShard(2, 2, 0, 32)]
        else:
            shards = [ExpertShard(0, 4, 0, 16), ExpertShard(0, 4, 16, 16)]
        assert [decode(h, ExpertReport).layers[layer] for h in held] == shards
    finally:
        stop(handle)
