"""Hostile input over HTTP, against one real engine with both front ends (in process): values
past 64 bits and lone surrogates refused by name while another user's stream goes on (and the
gRPC API refusing them in the same words), bodies over --max-request-body refused before they
are read while /health keeps answering, chat content as text parts, template arguments that
collide, an OpenAI error body for every error, and a non-streamed request aborted when its
client leaves."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from cluster.cli import build_parser, engine_config
from cluster.client import (
    Client,
    InvalidRequestError,
    OverloadedError,
    RequestTooLargeError,
)
from tests.cluster.http_helpers import (
    CHAT,
    COMPLETION,
    HEADERS,
    KEY,
    MODEL,
    VOCAB,
    assert_openai_error,
    chat_server,
    engine_stats,
    metrics,
    post,
    url,
    wait_until_idle,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with chat_server(tmp_path_factory.mktemp("chat-model")) as running:
        yield running


PAST_THE_WIRE = [
    ({"seed": 2**70}, "seed", r"[-9223372036854775808, 9223372036854775807]"),
    ({"top_k": 2**70}, "top_k", "-1 or 0 (off), or in [1, 300]"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids[0]", "in [0, 300)"),
    ({"min_tokens": 2**70}, "min_tokens", "in [0, 256]"),
]
SURROGATES = [  # JSON's escapes, as a client that never checks would send them
    ("/v1/completions", '"stop": ["\\ud800"]', "stop[0]"),
    ("/v1/completions", '"prompt": "a\\ud800"', "prompt"),
    ("/v1/completions", '"cache_salt": "\\udfff"', "cache_salt"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800"}]', "messages"),
]


def stream_in_background(server, tokens: list) -> threading.Thread:
    body = {**COMPLETION, "max_tokens": 120, "ignore_eos": True, "stream": True}

    def run():
        with httpx.stream(
            "POST", url(server, "/v1/completions"), json=body, headers=HEADERS, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    tokens.append(event.get("error") or event["choices"][0]["text"])

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_values_past_64_bits_and_lone_surrogates_fail_alone(server):
    events: list = []
    background = stream_in_background(server, events)
    while not events:
        time.sleep(0.01)
    for fields, param, allowed in PAST_THE_WIRE:
        error = assert_openai_error(post(server, "/v1/completions", {**COMPLETION, **fields}), 400)
        assert error["param"] == param and allowed in error["message"], error
    for path, field, param in SURROGATES:
        base = COMPLETION if path == "/v1/completions" else CHAT
        raw = json.dumps(base)[:-1] + ", " + field + "}"
        error = assert_openai_error(post(server, path, raw.encode()), 400)
        assert error["param"].startswith(param) and "lone surrogate" in error["message"], error
    background.join(timeout=120)
    assert all(isinstance(text, str) for text in events) and len(events) == 120  # no error
    assert engine_stats(server)["rebuilds"] == 0
    assert httpx.get(url(server, "/health")).status_code == 200


def test_the_grpc_api_refuses_the_same_values_in_the_same_words(server):
    cases = [
        {"top_k": VOCAB + 1},
        {"stop_token_ids": [VOCAB]},
        {"min_tokens": 257},
        {"max_tokens": 2**62},
    ]
    with Client(server.address, api_key=KEY, timeout=60) as client:
        for fields in cases:
            response = post(server, "/v1/completions", {**COMPLETION, **fields})
            http = assert_openai_error(response, 400)
            with pytest.raises(InvalidRequestError) as info:
                client.generate("hi", **{**{"max_tokens": 3}, **fields})
            assert str(info.value) == http["message"]


def test_n_choices_with_the_largest_seed_wrap_within_64_bits(server):
    body = {**COMPLETION, "n": 3, "seed": 2**63 - 1, "temperature": 1.0}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 3


# -- large bodies ----------------------------------------------------------------------------


# A client in its own process, so the bytes it builds and sends share no interpreter with the
# server (in this process) or with the health probe that measures it.
HOSTILE_CLIENT = """
import http.client, json, sys, time
host, port, key, model, chars = *sys.argv[1:5], int(sys.argv[5])
message = {"role": "user", "content": "x" * chars}
body = json.dumps({"model": model, "messages": [message], "max_tokens": 3}).encode()
connection = http.client.HTTPConnection(host, int(port), timeout=60)
started = time.perf_counter()
try:
    connection.request("POST", "/v1/chat/completions", body,
                       {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
except (BrokenPipeError, ConnectionResetError):
    pass  # refused before all of it was sent: the answer is waiting
response = connection.getresponse()
answer = response.read().decode()
print(json.dumps({"status": response.status, "body": answer,
                  "seconds": time.perf_counter() - started}))
"""


def chat_from_another_process(server, num_chars: int) -> tuple[dict, list[float]]:
    """What a chat body of ``num_chars`` characters got, and /health's latencies while it was
    sent and answered."""
    host, port = server.http.address.rsplit(":", 1)
    command = [sys.executable, "-c", HOSTILE_CLIENT, host, port, KEY, MODEL, str(num_chars)]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    latencies = []
    with httpx.Client(timeout=10) as probe:
        while client.poll() is None:
            started = time.perf_counter()
            assert probe.get(url(server, "/health")).status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    result = json.loads(client.stdout.read())
    result["error"] = json.loads(result["body"])["error"]
    return result, latencies


def test_a_50_mb_chat_body_is_refused_at_once_while_health_answers(server):
    result, latencies = chat_from_another_process(server, 50 << 20)
    assert result["status"] == 413 and result["error"]["code"] == 413, result
    assert "at most 4194304 bytes" in result["error"]["message"]
    assert "--max-request-body" in result["error"]["message"]
    assert result["seconds"] < 1.0, result["seconds"]
    assert latencies and max(latencies) < 0.1, latencies

    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (5 << 20)}]})

    def chunks():  # no Content-Length: refused once 4 MiB have been read
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)].encode()

    error = assert_openai_error(post(server, "/v1/chat/completions", chunks()), 413)
    assert "more than 4194304 bytes" in error["message"]


def test_the_same_limit_holds_for_grpc_and_comes_from_one_flag(server):
    with Client(server.address, api_key=KEY, timeout=60) as client:
        with pytest.raises(RequestTooLargeError) as info:
            client.generate("x" * (5 << 20), max_tokens=1)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4194304" in str(info.value) and "--max-request-body" in str(info.value)
        assert isinstance(info.value, InvalidRequestError)  # not an overloaded server
        assert not isinstance(info.value, OverloadedError)
        assert len(client.generate("still here", max_tokens=2).token_ids) == 2
    args = build_parser().parse_args(["serve", "--max-request-body", "8MiB"])
    assert engine_config(args).max_request_body_bytes == 8 << 20
    assert engine_config(build_parser().parse_args(["serve"])).max_request_body_bytes == 4 << 20


def test_a_conversation_too_long_for_the_context_is_refused_before_rendering(server):
    # Under the body limit, far over what 256 tokens can hold.
    result, latencies = chat_from_another_process(server, 3 << 20)
    assert result["status"] == 400, result
    num_chars = (3 << 20) + len("user")  # every string of the conversation counts
    assert f"holds {num_chars} characters" in result["error"]["message"]
    assert result["error"]["param"] == "messages"
    assert result["seconds"] < 1.0 and max(latencies) < 0.1, (result["seconds"], latencies)


# -- chat content and templates --------------------------------------------------------------


def test_text_parts_render_as_their_text_joined_by_newlines(server):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    as_parts = post(
        server, "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": parts}], "temperature": 0},
    ).json()  # fmt: skip
    as_text = post(
        server, "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "What is\nthe capital?"}],
         "temperature": 0},
    ).json()  # fmt: skip
    # The same prompt tokens: the second request even finds the first one's blocks cached.
    assert as_parts["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    assert as_text["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]


def test_template_arguments_and_template_errors_are_refused_by_name(server):
    for taken in ("add_generation_prompt", "messages"):
        body = {**CHAT, "chat_template_kwargs": {taken: False}}
        error = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
        assert error["param"] == "chat_template_kwargs" and taken in error["message"]
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]}  # fmt: skip
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    assert "chat template" in error["message"] and "content" in error["message"], error


# -- every error is an OpenAI error body -----------------------------------------------------


def test_every_error_is_an_openai_error_body(server):
    cases = [
        (httpx.get(url(server, "/nope")), 404),
        (post(server, "/v1/nope", COMPLETION), 404),
        (httpx.get(url(server, "/v1/completions"), headers=HEADERS), 405),
        (httpx.put(url(server, "/health")), 405),
        (post(server, "/v1/completions", b'{"model": "tiny-chat", "prompt": "\xff\xfe"}'), 400),
        (post(server, "/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400),
        (post(server, "/v1/completions", b"{not json"), 400),
        (post(server, "/v1/completions", b'{"prompt": 1' + b"0" * 5000 + b"}"), 400),
        (post(server, "/v1/completions", {**COMPLETION, "max_tokens": "many"}), 400),
        (post(server, "/v1/completions", [1, 2]), 400),
        (post(server, "/v1/completions", {**COMPLETION, "model": "gpt-4"}), 404),
        (httpx.post(url(server, "/v1/completions"), json=COMPLETION), 401),
    ]
    for response, status in cases:
        assert_openai_error(response, status)
    assert response.headers["content-type"] == "application/json"
    assert assert_openai_error(cases[8][0], 400)["param"] == "max_tokens"
    assert "POST" in cases[2][0].headers["allow"]


def test_an_unexpected_failure_is_a_500_with_an_openai_body(server):
    tokenizer = server.engine.tokenizer

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    tokenizer.encode = broken
    try:
        error = assert_openai_error(post(server, "/v1/completions", COMPLETION), 500)
    finally:
        del tokenizer.encode
    assert "RuntimeError: tokenizer exploded" in error["message"]
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


# -- a client that leaves --------------------------------------------------------------------


def aborted(server) -> float:
    labels = (("finished_reason", "abort"), ("model_name", MODEL))
    return metrics(server).get(("kvray:request_success_total", labels), 0.0)


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    before = aborted(server)
    body = json.dumps({**COMPLETION, "max_tokens": 250, "ignore_eos": True}).encode()
    host, port = server.http.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: kvray\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 30
        while engine_stats(server)["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine_stats(server)["in_flight"] == 1
    stats = wait_until_idle(server)
    assert stats["free"] == stats["usable"] and stats["in_flight"] == 0, stats
    assert aborted(server) == before + 1
