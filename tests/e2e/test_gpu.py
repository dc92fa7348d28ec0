"""What only a GPU shows, run by ``python -m cluster.bench.gpu_check`` where one exists:
serving through Ray with the Triton backend in every layout (compiled kernels, not the
interpreter), bf16 attention executed, sampling at temperature > 0 on the GPU, the KV cache
sized from the device's measured memory, TP 2 over NCCL when two GPUs are there, and a
DeepSeek (MLA) model through the compiled latent kernels.
Skipped on machines without CUDA; CI runs the same paths on CPUs in tests/cluster."""

from __future__ import annotations

import pytest
import ray
import torch

import kvcore
from cluster.client import Client
from cluster.config import EngineConfig
from cluster.controller import start_controller
from cluster.local import LocalServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SETTINGS = dict(port=0, max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=64)
PROMPTS = ["The first GPU prompt", [7, 8, 9, 10, 11, 12], "a third, longer prompt " * 5]


@pytest.fixture(scope="module")
def gpu_ray():
    ray.init(include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def greedy(address: str, max_tokens: int = 24) -> list[list[int]]:
    with Client(address, timeout=300) as client:
        return [client.generate(p, max_tokens=max_tokens, temperature=0).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference_tokens():
    """The torch backend on this GPU: the triton kernels must give the same tokens."""
    with LocalServer(EngineConfig(**SETTINGS, attention_backend="torch")) as server:
        return greedy(server.address)


def served(**settings):
    handle, info = start_controller(EngineConfig(**{**SETTINGS, **settings}))
    return handle, info["address"]


def stop(handle) -> None:
    ray.get(handle.stop.remote())
    ray.kill(handle)


@pytest.mark.parametrize("layout", kvcore.valid_layout_names())
def test_triton_serves_every_layout_with_the_reference_tokens(gpu_ray, reference_tokens, layout):
    handle, address = served(attention_backend="triton", kv_cache_layout=layout)
    try:
        assert greedy(address) == reference_tokens
        with Client(address) as client:
            info = client.info()
        assert info["attention_backend"] == "triton" and info["kv_cache_layout"] == layout
        assert info["num_blocks"] > 1000  # sized from the device's memory, not a CPU budget
    finally:
        stop(handle)


def test_sampling_at_a_positive_temperature_and_bf16(gpu_ray):
    handle, address = served(dtype="bfloat16")  # triton is the GPU default
    try:
        with Client(address, timeout=300) as client:
            seeded = dict(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=3)
            first = client.generate(PROMPTS[0], **seeded).token_ids
            assert client.generate(PROMPTS[0], **seeded).token_ids == first
            unseeded = client.generate(PROMPTS[2], max_tokens=32, temperature=1.0)
            assert len(unseeded.token_ids) == 32
            assert greedy(address) == greedy(address)  # bf16 kernels are deterministic
    finally:
        stop(handle)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_over_nccl(gpu_ray, reference_tokens):
    handle, address = served(tensor_parallel_size=2, placement_strategy="STRICT_PACK")
    try:
        assert greedy(address) == reference_tokens
    finally:
        stop(handle)


def test_a_deepseek_mla_model_matches_transformers(gpu_ray, tmp_path):
    """A tiny DeepSeek-V3 in fp32 through the compiled MLA kernels: the latent write, the
    split-KV latent decode and the expanded paged prefill. A step budget of 64 tokens sends
    the 150-token prompt's later chunks through latent-space prefill; the repeated prompt
    reads its first 144 tokens' latents from the prefix cache."""
    from tests.workers.hf_models import reference_generations, save_deepseek

    model_dir = save_deepseek(tmp_path / "deepseek", q_lora_rank=24)
    prompt = [3 + (7 * i + 1) % 297 for i in range(150)]  # no pad, BOS or EOS ids
    (expected,) = reference_generations(model_dir, [prompt], 16)
    handle, address = served(
        model=str(model_dir), attention_backend="triton", max_num_batched_tokens=64
    )
    try:
        with Client(address, timeout=300) as client:
            first = client.generate(prompt, max_tokens=16, temperature=0)
            again = client.generate(prompt, max_tokens=16, temperature=0)
        assert first.token_ids == again.token_ids == expected
        assert again.usage.cached_prompt_tokens == 144
    finally:
        stop(handle)
