"""Mixture-of-experts models against transformers, beyond test_hf_parity's cases (every Llama
family sibling at TP 1 and TP 2 with experts split by their intermediate dimension, across
layouts, chunked prefill and a prefix hit): expert parallelism at TP 2 (whole experts per
rank, each rank adding only its experts' outputs), preempted requests recomputing through the
experts, and DeepSeek's MoE (V3's biased sigmoid routing over expert groups, V2's softmax,
greedy or group-limited; shared experts) under multi-head latent attention, at TP 2 with
expert parallelism too."""

from __future__ import annotations

import pytest

from kvcore import decode, encode
from tests.workers.engine import (
    prompt_batches,
    run_in_process,
    run_tensor_parallel,
    start_worker,
    tiny_model_options,
)
from tests.workers.harness import StepDriver
from tests.workers.hf_models import (
    NUM_OUTPUT_TOKENS,
    PROMPTS,
    reference_generations,
    save_deepseek_moe,
    save_model,
)
from workers.protocol import StepResult

DEEPSEEK = {
    "deepseek-v3": dict(version=3),
    "deepseek-v2-limited": dict(version=2, topk_method="group_limited_greedy"),
    "deepseek-v2-greedy": dict(version=2, topk_method="greedy", n_group=None, topk_group=None),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (model dir, reference outputs by request id)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            if family in DEEPSEEK:
                save_deepseek_moe(directory, **DEEPSEEK[family])
            else:
                save_model(family, directory)
            reference = reference_generations(directory, PROMPTS)
            cache[family] = directory, {f"r{i}": out for i, out in enumerate(reference)}
        return cache[family]

    return get


@pytest.mark.parametrize(
    ("family", "layout", "chunk"),
    [("mixtral", "BLHNC", 7), ("qwen2-moe", "LBNHC", 64), ("qwen3-moe", "BHLNC", 5)],
)
def test_expert_parallel_at_tp2_matches_transformers(models, family, layout, chunk):
    model_dir, expected = models(family)
    options = tiny_model_options(model_dir, tp=2, enable_expert_parallel=True)
    outputs = run_tensor_parallel(
        options, layout, prompt_batches(PROMPTS, NUM_OUTPUT_TOKENS), chunk=chunk
    )
    assert outputs == expected
    assert all(len(set(tokens)) > 8 for tokens in expected.values())


def test_preempted_requests_recompute_through_the_experts(models):
    model_dir, expected = models("qwen3-moe")
    worker = start_worker(tiny_model_options(model_dir), "LBHNC")
    driver = StepDriver(
        worker.runner.config, lambda p: decode(worker.execute(encode(p)), StepResult)
    )
    requests = [(f"r{i}", p, NUM_OUTPUT_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = driver.generate(requests, chunk=7, preempt_after={"r0": 20, "r1": 12, "r2": 25})
    assert outputs == expected


@pytest.mark.parametrize(
    ("family", "tp", "expert_parallel", "layout", "chunk"),
    [
        ("deepseek-v3", 1, False, "BLHNC", 7),
        ("deepseek-v2-limited", 1, False, "LBNHC", 5),
        ("deepseek-v2-greedy", 1, False, "BHLNC", 64),
        ("deepseek-v3", 2, True, "LBHNC", 6),
        ("deepseek-v2-limited", 2, False, "BLNHC", 9),
    ],
)
def test_deepseek_moe_with_latent_attention_matches_transformers(
    models, family, tp, expert_parallel, layout, chunk
):
    model_dir, expected = models(family)
    options = tiny_model_options(model_dir, tp=tp, enable_expert_parallel=expert_parallel)
    run = run_in_process if tp == 1 else run_tensor_parallel
    outputs = run(options, layout, prompt_batches(PROMPTS, NUM_OUTPUT_TOKENS), chunk=chunk)
    assert outputs == expected
    assert all(len(set(tokens)) > 8 for tokens in expected.values())
