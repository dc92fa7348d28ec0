"""A dense DeepSeek-V3 (multi-head latent attention, ``q_lora_rank`` set) through the ``kvray``
command: ``generate`` prints transformers' tokens as JSON (in process; ``serve`` covers Ray);
``serve`` at TP 2 answers the client with them and hits its prefix cache."""

from __future__ import annotations

import pytest

from tests.cluster.test_cli import generate_token_ids, serve_twice
from tests.workers.hf_models import reference_generations, save_deepseek

# No id below 3 (the tiny DeepSeek-V3's BOS is 0, its EOS 1), and a greedy continuation
# without EOS in it.
PROMPT = [3 + (7 * i + 1) % 297 for i in range(150)]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_deepseek(tmp_path_factory.mktemp("deepseek_v3"), q_lora_rank=24)


@pytest.fixture(scope="module")
def expected(model_dir):
    (tokens,) = reference_generations(model_dir, [PROMPT], NUM_TOKENS)
    return tokens


def test_generate_prints_transformers_tokens_as_json(model_dir, expected):
    completion = generate_token_ids(model_dir, PROMPT, NUM_TOKENS)
    assert completion["token_ids"] == expected
    assert completion["usage"]["prompt_tokens"] == len(PROMPT)


def test_serve_at_tp2_answers_and_reuses_the_latents_of_a_repeated_prompt(model_dir, expected):
    first, again = serve_twice(model_dir, PROMPT, NUM_TOKENS, "-tp", "2")
    assert first.token_ids == again.token_ids == expected
    # The last prompt token is always computed, so the hit is every full block of the
    # default 16 tokens before it: (150 - 1) // 16 * 16 = 144 tokens of cached latents.
    assert (first.usage.cached_prompt_tokens, again.usage.cached_prompt_tokens) == (0, 144)
