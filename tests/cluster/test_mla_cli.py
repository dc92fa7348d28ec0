"""A dense DeepSeek-V3 (multi-head latent attention, ``q_lora_rank`` set) through the ``kvray``
command: ``generate`` prints transformers' tokens as JSON (in process; ``serve`` covers Ray);
``serve`` at TP 2 answers the client with them and hits its prefix cache."""

from __future__ import annotations

import json
import signal

import pytest

from cluster.client import Client
from tests.cluster.test_cli import SMALL, run, start_serving
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
    result = run(
        "generate",
        "--in-process",
        "--model",
        str(model_dir),
        "--prompt-token-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        str(NUM_TOKENS),
        "--temperature",
        "0",
        "--output",
        "json",
        *SMALL,
    )
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    assert completion["token_ids"] == expected
    assert completion["usage"]["prompt_tokens"] == len(PROMPT)


def test_serve_at_tp2_answers_and_reuses_the_latents_of_a_repeated_prompt(model_dir, expected):
    server, address, _, seen = start_serving("--model", str(model_dir), "-tp", "2")
    try:
        with Client(address, timeout=120) as client:
            first = client.generate(PROMPT, max_tokens=NUM_TOKENS, temperature=0)
            again = client.generate(PROMPT, max_tokens=NUM_TOKENS, temperature=0)
        assert first.token_ids == again.token_ids == expected
        # The last prompt token is always computed, so the hit is every full block of the
        # default 16 tokens before it: (150 - 1) // 16 * 16 = 144 tokens of cached latents.
        assert (first.usage.cached_prompt_tokens, again.usage.cached_prompt_tokens) == (0, 144)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, "".join(seen)
