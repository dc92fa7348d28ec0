"""Sampling: seeded requests are reproducible; the filters do what they say; bad values fail."""

from __future__ import annotations

import pytest
import torch

from kvcore import decode, encode
from tests.workers.engine import plan_for
from tests.workers.harness import StepDriver
from workers.default_model import DEFAULT_CONFIG
from workers.sampling import Sampler, SamplingParams
from workers.step_plan import StepResult
from workers.worker import Worker, WorkerOptions


@pytest.fixture(scope="module")
def default_worker():
    worker = Worker(0, WorkerOptions(kv_cache_memory_bytes=16 << 20, block_size=16))
    worker.init_tp_group(None)
    worker.load_model()
    worker.allocate_kv_cache(encode(plan_for(worker, "LBNHC")))
    return worker


def generate(worker, prompt, sampling, request_id="r"):
    driver = StepDriver(
        worker.runner.config, lambda plan: decode(worker.execute(encode(plan)), StepResult)
    )
    driver.next_block = 1
    return driver.generate([(request_id, prompt, sampling.max_tokens)], sampling=sampling)[
        request_id
    ]


def test_seeded_sampling_gives_the_same_tokens_twice(default_worker):
    prompt = list(b"The quick brown fox")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=24)
    first = generate(default_worker, prompt, seeded)
    second = generate(default_worker, prompt, seeded)
    assert first == second
    assert len(set(first)) > 4
    other_seed = generate(
        default_worker,
        prompt,
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=24),
    )
    assert other_seed != first


def test_greedy_default_model_is_deterministic(default_worker):
    prompt = list(b"hello")
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    assert generate(default_worker, prompt, greedy) == generate(default_worker, prompt, greedy)
    assert DEFAULT_CONFIG.vocab_size == 258


def test_top_k_one_is_greedy_and_top_p_keeps_the_top_token():
    sampler = Sampler()
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=2.0, top_k=1)] * 2 + [
        SamplingParams(temperature=2.0, top_p=1e-6)
    ] * 2
    assert sampler.sample(logits, ["a", "b", "c", "d"], params).tolist() == greedy


def test_top_k_restricts_the_draw():
    sampler = Sampler()
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=3)]
    draws = {int(sampler.sample(logits, ["x"], params)[0]) for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
    ],
)
def test_bad_sampling_values_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)
