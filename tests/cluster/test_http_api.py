"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client against a real
engine (in process, with its gRPC server beside): completions and chat, streamed and not,
``n``, ``logprobs``, ``stop``, usage, every error status, and ``/metrics`` parsed with
``prometheus_client``'s parser, its counters moving as requests run."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from cluster.client import Client
from tests.cluster.http_helpers import KEY, MODEL, chat_server, metrics


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with chat_server(tmp_path_factory.mktemp("chat-model")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.http.address}/v1", api_key=KEY, max_retries=0)


def test_models_health_and_version(server, client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 256
    base = f"http://{server.http.address}"
    assert httpx.get(f"{base}/health").status_code == 200  # no key needed
    assert httpx.get(f"{base}/version").json()["version"]


def test_completions_with_n_logprobs_and_usage(client):
    done = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=6, n=2, seed=11, temperature=1.0, logprobs=2
    )
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in done.choices)
    assert done.choices[0].text != done.choices[1].text or done.choices[0].logprobs.tokens
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(v <= 0 and math.isfinite(v) for v in logprobs.token_logprobs)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert done.usage.prompt_tokens == len("Once upon")  # byte tokens, counted once for n=2
    assert done.usage.completion_tokens == 12
    again = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=6, n=2, seed=11, temperature=1.0
    )
    assert [c.text for c in again.choices] == [c.text for c in done.choices]  # seeded


def test_token_id_prompts_and_stop_strings(client):
    greedy = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    assert greedy.usage.prompt_tokens == 2
    if len(text) > 3:
        stop = text[2:4]
        cut = client.completions.create(
            model=MODEL, prompt=[72, 105], max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.index(stop)]


def test_streamed_completion_ends_with_usage_then_done(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream(
        "POST", f"http://{server.http.address}/v1/completions", json=body,
        headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
    ) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 5)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    (choice,) = done.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.content) == done.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    # The ChatML template rendered the default system prompt and the generation prompt.
    rendered = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    specials = ["<|im_start|>"] * 3 + ["<|im_end|>"] * 2  # one token each; the rest are bytes
    expected = len(rendered.encode()) - sum(len(s) for s in specials) + len(specials)
    assert done.usage.prompt_tokens == expected
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_error_statuses(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=float("-1"))
    with pytest.raises(openai.BadRequestError, match="does not support"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logit_bias={"1": 5}
        )
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    anonymous = openai.OpenAI(
        base_url=f"http://{server.http.address}/v1", api_key="wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)


def test_overload_and_unavailable(server, client):
    engine = server.engine
    server.run(_set(engine, "max_queue_len", 0))
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        server.run(_set(engine, "max_queue_len", 1024))

    async def stop_taking():
        from cluster.engine import EngineState

        engine._set_state(EngineState.DRAINING, "The server is shutting down; retry elsewhere.")

    async def take_again():
        from cluster.engine import EngineState

        engine._set_state(EngineState.SERVING)

    server.run(stop_taking())
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert info.value.status_code == 503
        assert httpx.get(f"http://{server.http.address}/health").status_code == 503
    finally:
        server.run(take_again())


async def _set(engine, name, value):
    setattr(engine, name, value)


def test_metrics_move_as_requests_run(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4, temperature=0)
    with Client(server.address, api_key=KEY) as grpc_client:  # the gRPC side counts too
        grpc_client.generate("and me", max_tokens=3, temperature=0)
    after = metrics(server)
    label = (("model_name", MODEL),)

    def grew(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("kvray:generation_tokens_total") == 7
    assert grew("kvray:prompt_tokens_total") == len("count me") + len("and me")
    success = (("finished_reason", "length"), ("model_name", MODEL))
    assert grew("kvray:request_success_total", success) == 2
    assert grew("kvray:time_to_first_token_seconds_count") == 2
    assert grew("kvray:e2e_request_latency_seconds_count") == 2
    assert 0 <= after[("kvray:kv_cache_usage_perc", label)] <= 1
    assert ("kvray:num_requests_running", label) in after


def test_many_concurrent_requests_through_the_async_client(server):
    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"http://{server.http.address}/v1", api_key=KEY, max_retries=0
        ) as aclient:
            results = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=MODEL, prompt=f"request {i}", max_tokens=5, temperature=0
                    )
                    for i in range(24)
                )
            )
        return results

    results = asyncio.run(main())
    assert all(r.usage.completion_tokens == 5 for r in results)
