"""A mixture-of-experts checkpoint (Qwen2-MoE: dense and MoE layers, a gated shared expert)
through the ``kvray`` command: ``generate`` prints transformers' tokens as JSON; ``serve`` at
TP 2 with expert parallelism answers the client and the OpenAI API with them; ``plan`` prints
what each rank holds of the experts without loading weights; a split that cannot be made is
refused before Ray starts."""

from __future__ import annotations

import signal

import httpx
import pytest

from cluster.client import Client
from tests.cluster.test_cli import generate_token_ids, run, start_serving
from tests.workers.hf_models import PROMPTS, reference_generations, save_model

NUM_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model("qwen2-moe", tmp_path_factory.mktemp("qwen2-moe"))


@pytest.fixture(scope="module")
def expected(model_dir):
    (tokens,) = reference_generations(model_dir, [PROMPTS[2]], NUM_TOKENS)
    return tokens


def test_generate_prints_transformers_tokens_as_json(model_dir, expected):
    assert generate_token_ids(model_dir, PROMPTS[2], NUM_TOKENS)["token_ids"] == expected


def test_serve_at_tp2_with_expert_parallelism_answers_both_apis(model_dir, expected):
    server, address, base_url, seen = start_serving(
        "--model", str(model_dir), "-tp", "2", "--enable-expert-parallel"
    )
    try:
        with Client(address, timeout=120) as client:
            answer = client.generate(PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0)
        assert answer.token_ids == expected
        body = {"model": str(model_dir), "prompt": PROMPTS[2], "max_tokens": NUM_TOKENS,
                "temperature": 0, "logprobs": 1}  # fmt: skip
        reply = httpx.post(base_url.split(";")[0] + "/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == NUM_TOKENS
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, "".join(seen)


def test_plan_prints_each_ranks_experts(model_dir):
    result = run("plan", "--model", str(model_dir), "-tp", "2", "--enable-expert-parallel",
                 "--kv-cache-memory", "8MiB")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "experts: 2 MoE layers of 4 experts (32 rows each), top 2, a shared expert of 64 rows; "
        "whole experts per rank (expert parallel)" in result.stdout
    )
    assert "  rank 1: experts [2, 4), rows [0, 32) of each" in result.stdout
    split = run("plan", "--model", str(model_dir), "-tp", "2", "--kv-cache-memory", "8MiB")
    assert "  rank 1: experts [0, 4), rows [16, 32) of each" in split.stdout


def test_an_expert_split_that_cannot_be_made_is_refused_before_ray_starts(model_dir):
    result = run("serve", "--model", str(model_dir), "-tp", "8", "--enable-expert-parallel",
                 timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "needs num_experts=4 divisible by tensor parallel size 8" in result.stderr
    assert "Traceback" not in result.stderr
