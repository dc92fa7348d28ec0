"""Mixture-of-experts models against transformers, beyond test_hf_parity's cases (every Llama
family sibling and gpt-oss at TP 1 and TP 2 with experts split by their intermediate
dimension): expert parallelism at TP 2 (whole experts per rank, each rank adding only its
experts' outputs); DeepSeek's MoE (V3's biased sigmoid routing over expert groups, V2's
softmax, greedy or group-limited; shared experts) under multi-head latent attention, at TP 2
with expert parallelism too; NemotronH's E layers; and preempted requests recomputing through
the experts, for every family. Every run is in prefill chunks off the block boundaries and,
but for the hybrid, ends with a second batch whose prompts hit the first's cached blocks."""

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
    save_nemotron_h,
)
from tests.workers.test_hf_parity import HIT_PROMPTS, batches
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
            prompts = PROMPTS + [prompt for _, prompt in HIT_PROMPTS.values()]
            ids = [f"r{i}" for i in range(len(PROMPTS))] + list(HIT_PROMPTS)
            reference = reference_generations(directory, prompts)
            cache[family] = directory, dict(zip(ids, reference, strict=True))
        return cache[family]

    return get


@pytest.mark.parametrize(
    ("family", "layout", "chunk"),
    [("mixtral", "BLHNC", 7), ("qwen2-moe", "LBNHC", 64), ("qwen3-moe", "BHLNC", 5),
     ("gpt-oss", "LBHNC", 6)],
)  # fmt: skip
def test_expert_parallel_at_tp2_matches_transformers(models, family, layout, chunk):
    model_dir, expected = models(family)
    options = tiny_model_options(model_dir, tp=2, enable_expert_parallel=True)
    outputs = run_tensor_parallel(options, layout, batches(), chunk=chunk)
    assert outputs == expected
    assert all(len(set(tokens)) > 8 for tokens in expected.values())


@pytest.mark.parametrize(
    "family", ["mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss", "deepseek-v3", "deepseek-v2-limited"]
)
def test_preempted_requests_recompute_through_the_experts(models, family):
    model_dir, expected = models(family)
    worker = start_worker(tiny_model_options(model_dir), "LBHNC")
    driver = StepDriver(
        worker.runner.config, lambda p: decode(worker.execute(encode(p)), StepResult)
    )
    requests = [(f"r{i}", p, NUM_OUTPUT_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = driver.generate(requests, chunk=7, preempt_after={"r0": 20, "r1": 12, "r2": 25})
    assert outputs == {rid: expected[rid] for rid in outputs}


@pytest.mark.parametrize(
    ("family", "tp", "expert_parallel", "layout", "chunk"),
    [
        ("deepseek-v3", 1, False, "BLHNC", 7),
        ("deepseek-v2-limited", 1, False, "LBNHC", 5),
        ("deepseek-v2-greedy", 1, False, "BHLNC", 64),
        ("deepseek-v3", 2, True, "LBHNC", 6),
    ],
)
def test_deepseek_moe_with_latent_attention_matches_transformers(
    models, family, tp, expert_parallel, layout, chunk
):
    model_dir, expected = models(family)
    options = tiny_model_options(model_dir, tp=tp, enable_expert_parallel=expert_parallel)
    run = run_in_process if tp == 1 else run_tensor_parallel
    outputs = run(options, layout, batches(), chunk=chunk)
    assert outputs == expected
    assert all(len(set(tokens)) > 8 for tokens in expected.values())


NEMOTRON_MOE = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def nemotron_moe(tmp_path_factory):
    """name -> (model dir, reference): NemotronH hybrids with E layers, with and without the
    experts' latent projections; their score biases drawn (transformers starts them at 0)."""
    cache = {}

    def get(latent: int):
        if latent not in cache:
            directory = save_nemotron_h(
                tmp_path_factory.mktemp("nemotron_moe"), "M*E-E", 1, **NEMOTRON_MOE,
                moe_latent_size=latent or None, score_bias_std=0.2,
            )  # fmt: skip
            reference = reference_generations(directory, PROMPTS)
            cache[latent] = directory, {f"r{i}": out for i, out in enumerate(reference)}
        return cache[latent]

    return get


@pytest.mark.parametrize(
    ("latent", "tp", "expert_parallel", "layout", "chunk"),
    [(0, 1, False, "BLHNC", 7), (16, 1, False, "LBHNC", 5), (16, 2, True, "BLNHC", 6)],
)  # fmt: skip
def test_nemotron_h_moe_layers_match_transformers(
    nemotron_moe, latent, tp, expert_parallel, layout, chunk
):
    model_dir, expected = nemotron_moe(latent)
    options = tiny_model_options(model_dir, tp=tp, enable_expert_parallel=expert_parallel)
    run = run_in_process if tp == 1 else run_tensor_parallel
    outputs = run(options, layout, prompt_batches(PROMPTS, NUM_OUTPUT_TOKENS), chunk=chunk)
    assert outputs == expected
    assert all(len(set(tokens)) > 8 for tokens in expected.values())


def test_nemotron_h_preempted_requests_recompute_states_and_experts(nemotron_moe):
    model_dir, expected = nemotron_moe(16)
    worker = start_worker(tiny_model_options(model_dir), "BLHNC")
    driver = StepDriver(
        worker.runner.config, lambda p: decode(worker.execute(encode(p)), StepResult)
    )
    requests = [(f"r{i}", p, NUM_OUTPUT_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = driver.generate(requests, chunk=7, preempt_after={"r0": 20, "r1": 12, "r2": 25})
    assert outputs == expected
