"""Verifying drafts in the sampler: greedy rows accept a draft exactly when it is the argmax;
sampled rows use speculative sampling (accept with probability p(draft), else draw from p
without it), whose tokens must be distributed as p itself, checked here statistically on a
five-token vocabulary under temperature, top-k and top-p."""

from __future__ import annotations

import pytest
import torch

from workers.sampler import Sampler, SamplingRow
from workers.sampling import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, -0.5, 0.0])
NUM_DRAWS = 40_000


def expected_probs(params: SamplingParams) -> torch.Tensor:
    """What a plain draw gives, computed independently of the sampler's code."""
    logits = LOGITS / params.temperature
    order = logits.argsort(descending=True)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    if params.top_k:
        keep[order[: params.top_k]] = True
    else:
        keep[:] = True
    probs = torch.where(keep, torch.softmax(logits.masked_fill(~keep, -torch.inf), -1), 0.0)
    if params.top_p < 1.0:
        sorted_probs = probs[order]
        above = sorted_probs.cumsum(0) - sorted_probs
        dropped = order[above >= params.top_p]
        probs[dropped] = 0.0
    return probs / probs.sum()


def draw(params: SamplingParams, draft: int, sampler: Sampler | None = None):
    sampler = sampler or Sampler()
    rows = [SamplingRow(f"r{i}", params, (), ()) for i in range(NUM_DRAWS)]
    logits = LOGITS.expand(NUM_DRAWS, -1).clone()
    if params.seed is not None:
        for row in rows:
            sampler.add_request(row.request_id, params)
    sampled = sampler.sample_rows(logits, rows, drafts=[draft] * NUM_DRAWS)
    return sampled.tokens, sampled.accepted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top-k", "top-p"],
)
@pytest.mark.parametrize("draft", [0, 2, 4])
def test_tokens_after_verification_are_distributed_as_the_model_says(params, draft):
    torch.manual_seed(1)
    tokens, accepted = draw(params, draft)
    expected = expected_probs(params)
    counts = torch.bincount(tokens, minlength=5).double()
    observed = counts / NUM_DRAWS
    # Five standard errors of a binomial share, per token.
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / NUM_DRAWS) + 1e-9
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)
    # A draft is accepted as often as the model would have drawn it, and a token the filters
    # removed is never drawn, as a draft or otherwise.
    share_accepted = accepted.double().mean()
    assert abs(share_accepted - expected[draft]) <= 5 * (0.25 / NUM_DRAWS) ** 0.5
    assert torch.equal(tokens[accepted], torch.full_like(tokens[accepted], draft))
    assert counts[expected == 0].sum() == 0


def test_greedy_rows_accept_exactly_the_argmax():
    params = SamplingParams(temperature=0.0)
    rows = [SamplingRow(f"r{d}", params, (), ()) for d in range(5)]
    logits = LOGITS.expand(5, -1).clone()
    sampled = Sampler().sample_rows(logits, rows, drafts=[0, 1, 2, 3, 4])
    assert sampled.tokens.tolist() == [0] * 5
    assert sampled.accepted.tolist() == [True, False, False, False, False]


def test_rows_without_a_draft_draw_plainly_beside_rows_with_one():
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    rows = [SamplingRow("a", greedy, (), ()), SamplingRow("b", sampled, (), ())] * 2
    logits = LOGITS.expand(4, -1).clone()
    result = Sampler().sample_rows(logits, rows, drafts=[3, 3, None, None])
    assert result.accepted.tolist()[2:] == [False, False]
    assert result.tokens[0] == result.tokens[2] == 0  # greedy rows: the argmax either way


def test_a_seeded_request_verifies_the_same_way_twice():
    params = SamplingParams(temperature=1.0, seed=1234)
    first_tokens, first_accepted = draw(params, 1)
    second_tokens, second_accepted = draw(params, 1)
    assert torch.equal(first_tokens, second_tokens)
    assert torch.equal(first_accepted, second_accepted)
