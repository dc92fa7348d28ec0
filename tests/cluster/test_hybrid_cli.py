"""A Mamba-2 hybrid (NemotronH checkpoint directory) through the ``kvray`` command: the plan
shows its state groups and what keeping states costs, with and without speculation;
``generate`` prints transformers' tokens as JSON (in process; ``serve`` covers Ray); ``serve``
at TP 2 answers the client with them and hits its prefix cache."""

from __future__ import annotations

import re

import pytest

from tests.cluster.test_cli import generate_token_ids, run, serve_twice
from tests.workers.hf_models import reference_generations, save_nemotron_h

# No pad (0), BOS (1) or EOS (2) ids, and a greedy continuation without EOS in it.
PROMPT = [3 + (7 * i + 1) % 297 for i in range(150)]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_nemotron_h(tmp_path_factory.mktemp("nemotron_h"), "M*-M-", 2)


@pytest.fixture(scope="module")
def expected(model_dir):
    (tokens,) = reference_generations(model_dir, [PROMPT], NUM_TOKENS)
    return tokens


def concurrency(plan: str) -> float:
    return float(re.search(r"max concurrency ([0-9.]+)x", plan).group(1))


def test_plan_shows_the_state_groups_and_their_interval(model_dir):
    result = run("plan", "--model", str(model_dir), "--kv-cache-memory", "8MiB")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "(NemotronHForCausalLM), TP 1, 5 layers" in out
    assert out.count("MambaSpec: 1 layers, block 128 tokens") == 2  # one group per layer
    assert "mamba states: one kept every 128 tokens for prefix caching" in out
    assert "BHLNC: cannot express this model" in out
    # Speculating, each request also holds a draft state per draft in each Mamba group.
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    result = run("plan", "--model", str(model_dir), "--kv-cache-memory", "8MiB",
                 "--speculative-config", spec)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "mamba draft states: 3 per request and group" in result.stdout
    assert "mamba states: one kept every 128 tokens for prefix caching" in result.stdout
    # ... which take blocks: fewer requests fit at once.
    assert concurrency(result.stdout) < concurrency(out)


def test_generate_prints_transformers_tokens_as_json(model_dir, expected):
    completion = generate_token_ids(model_dir, PROMPT, NUM_TOKENS)
    assert completion["token_ids"] == expected
    assert completion["usage"]["prompt_tokens"] == len(PROMPT)


def test_serve_at_tp2_answers_and_reuses_the_states_of_a_repeated_prompt(model_dir, expected):
    first, again = serve_twice(model_dir, PROMPT, NUM_TOKENS, "-tp", "2")
    assert first.token_ids == again.token_ids == expected
    assert (first.usage.cached_prompt_tokens, again.usage.cached_prompt_tokens) == (0, 128)
