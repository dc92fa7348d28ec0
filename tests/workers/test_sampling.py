"""Sampling: seeded requests are reproducible; the filters do what they say; bad values fail."""

from __future__ import annotations

import pytest
import torch

from kvcore import decode, encode
from tests.workers.engine import start_worker
from tests.workers.harness import StepDriver
from workers.model_source import DEFAULT_CONFIG
from workers.protocol import StepResult
from workers.sampler import Sampler, row_argmax
from workers.sampling import SamplingParams
from workers.worker import WorkerOptions


@pytest.fixture(scope="module")
def default_worker():
    return start_worker(WorkerOptions(kv_cache_memory_bytes=16 << 20, block_size=16), "LBNHC")


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


def test_penalties_follow_their_formulas_row_by_row():
    """Repetition as transformers applies it (prompt and output tokens), presence and
    frequency as OpenAI defines them (output tokens, by count); rows without them untouched."""
    from workers.sampler import SamplingRow, _apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    penalised = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        SamplingRow("a", penalised, prompt_ids=[0], output_ids=[1, 3, 3]),
        SamplingRow("b", SamplingParams(), prompt_ids=[0], output_ids=[3]),
    ]
    out = _apply_penalties(logits, rows)
    # token 0: prompt only -> 2.0 / 2; token 1: output once -> -1 * 2 - 0.5 - 0.25;
    # token 2: unseen; token 3: output twice -> 3 / 2 - 2 * 0.5 - 0.25.
    assert out[0].tolist() == pytest.approx([1.0, -2.75, 0.5, 0.25])
    assert out[1].tolist() == logits[1].tolist()


def test_min_tokens_holds_back_eos_and_stop_tokens():
    from workers.sampler import Sampler, SamplingRow

    sampler = Sampler(eos_token_ids=(3,))
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])  # EOS (3) is the greedy choice, then 2
    early = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    held = sampler.sample_rows(logits, [SamplingRow("r", early, [5], [1])]).tokens
    assert held.tolist() == [1]  # EOS and the stop token are out until two tokens are out
    later = sampler.sample_rows(logits, [SamplingRow("r", early, [5], [1, 1])]).tokens
    assert later.tolist() == [3]


def test_logprobs_are_the_models_own_and_list_the_top_alternatives():
    from workers.sampler import Sampler, SamplingRow

    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, logprobs=0, seed=1),
    ]
    rows = [SamplingRow(f"r{i}", p, [], [4]) for i, p in enumerate(params)]
    sampler = Sampler()
    sampler.add_request("r2", params[2])
    sampled = sampler.sample_rows(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    assert set(sampled.logprobs) == {"r0", "r2"}
    for name, row in (("r0", 0), ("r2", 2)):
        token = int(sampled.tokens[row])
        assert sampled.logprobs[name].logprob == pytest.approx(float(expected[row, token]))
    top = sampled.logprobs["r0"].top
    assert [t for t, _ in top] == expected[0].topk(3).indices.tolist()
    assert sampled.logprobs["r2"].top == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_with_ties_nan_and_infinities(dtype):
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor(
        [[1.0, nan, 3.0, nan], [2.0, 2.0, 1.0, 0.0], [-inf] * 4, [0.0, inf, inf, 0.0]], dtype=dtype
    )
    wide = torch.randn(5, 49152, dtype=dtype)
    wide[1, 100] = wide[1, 40000] = wide[1].max() + 1  # a tie far apart: the first one wins
    for values in (rows, wide):
        assert torch.equal(row_argmax(values), values.argmax(dim=-1))
    assert row_argmax(rows).tolist() == [1, 0, 0, 1]
