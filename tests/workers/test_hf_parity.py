"""kvray's greedy tokens equal transformers' ``generate``, token for token.

Each case runs the three prompts together (continuous batching), in prefill chunks, then a
second batch whose prompts share whole blocks with finished requests (prefix-cache hits), and
compares all of it with transformers run one prompt at a time.
"""

from __future__ import annotations

import pytest

from tests.workers.engine import KV_CACHE_MEMORY, run_in_process, run_tensor_parallel
from tests.workers.hf_models import (
    NUM_OUTPUT_TOKENS,
    PROMPTS,
    reference_generations,
    save_model,
)
from workers.worker import WorkerOptions

# Second-round prompts: the first 16 tokens of an earlier prompt, then new tokens.
HIT_PROMPTS = {
    "hit0": ("r0", [*PROMPTS[0][:16], 250, 251, 252]),
    "hit2": ("r2", PROMPTS[2][:20]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (model dir, reference outputs by request id)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            directory = save_model(family, tmp_path_factory.mktemp(family))
            prompts = PROMPTS + [prompt for _, prompt in HIT_PROMPTS.values()]
            reference = reference_generations(directory, prompts)
            ids = [f"r{i}" for i in range(len(PROMPTS))] + list(HIT_PROMPTS)
            cache[family] = directory, dict(zip(ids, reference, strict=True))
        return cache[family]

    return get


def batches(num_tokens: int = NUM_OUTPUT_TOKENS):
    first = [(f"r{i}", p, num_tokens, None) for i, p in enumerate(PROMPTS)]
    second = [(rid, p, num_tokens, src) for rid, (src, p) in HIT_PROMPTS.items()]
    return [first, second]


# The Triton interpreter is slow: its cases compare the first tokens (greedy outputs are
# prefixes of longer ones), still past every prompt's first blocks and the sliding window.
TRITON_TOKENS = 12


CASES = [
    # family, backend, layout, tensor parallel size, prefill chunk
    ("llama", "torch", "LBNHC", 1, 7),
    ("llama-tied", "torch", "BLHNC", 1, 64),
    ("qwen2", "torch", "LHBNC", 1, 5),
    ("mistral", "torch", "BHLNC", 1, 9),
    ("qwen3-sliding", "torch", "BLHNC", 1, 7),
    ("qwen3-sliding", "torch", "LBHNC", 1, 64),
    ("qwen3-sliding", "triton", "BLNHC", 1, 7),
    ("llama", "triton", "LBNHC", 1, 11),
    ("llama", "torch", "BLNHC", 2, 6),
    ("qwen3-sliding", "torch", "LBNHC", 2, 7),
    ("qwen3-sliding", "triton", "BLHNC", 2, 7),
    # Mixture-of-experts (experts split by their intermediate rows at TP 2; test_moe_parity
    # has expert parallelism, and test_moe_serving Qwen2-MoE's split on Ray).
    ("mixtral", "torch", "LBHNC", 1, 7),
    ("qwen2-moe", "torch", "BLHNC", 1, 5),
    ("qwen3-moe", "torch", "LBNHC", 1, 64),
    ("qwen3-moe", "torch", "BHLNC", 2, 9),
    # gpt-oss: attention sinks, sliding and full layers, biased experts with a clamped SwiGLU.
    ("gpt-oss", "torch", "BLHNC", 1, 7),
    ("gpt-oss", "torch", "LBNHC", 2, 5),
]


@pytest.mark.parametrize(("family", "backend", "layout", "tp", "chunk"), CASES)
def test_greedy_tokens_match_transformers(models, family, backend, layout, tp, chunk):
    model_dir, expected = models(family)
    options = WorkerOptions(
        model=str(model_dir),
        tensor_parallel_size=tp,
        block_size=4,
        attention_backend=backend,
        kv_cache_memory_bytes=KV_CACHE_MEMORY,
    )
    run = run_in_process if tp == 1 else run_tensor_parallel
    num_tokens = TRITON_TOKENS if backend == "triton" else NUM_OUTPUT_TOKENS
    outputs = run(options, layout, batches(num_tokens), chunk=chunk)
    assert outputs == {rid: tokens[:num_tokens] for rid, tokens in expected.items()}
    # The model must not be trivially repetitive, or this comparison would prove little.
    assert all(len(set(tokens)) > 8 for tokens in expected.values())
