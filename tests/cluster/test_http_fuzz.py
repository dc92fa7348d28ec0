"""Random JSON bodies against both OpenAI routes of one running server (in process, with the
chat model): wrong types, integers far past 64 bits, NaN and infinities, unicode with lone
surrogates, nested structures, bodies cut short or not UTF-8, streams left early. Every answer
is a success or an OpenAI error body; none is a 5xx; and afterwards the server is healthy,
answers a greedy request as it did before, and holds no blocks.

Every request that reaches the scheduler first has its step-plan entry encoded (as the
scheduler will send it): a field that got past the limits table unchecked fails right there,
naming the request, instead of failing a step for everyone.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.scheduler.scheduler import new_request_message
from kvcore import encode
from tests.cluster.http_helpers import (
    CHAT,
    COMPLETION,
    HEADERS,
    MODEL,
    assert_openai_error,
    chat_server,
    url,
    wait_until_idle,
)

GREEDY = {"model": MODEL, "prompt": "The same answer, please:", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """The chat server, with every request's plan entry encoded as it joins the scheduler, and its
    greedy answer before any fuzzing."""
    with chat_server(tmp_path_factory.mktemp("chat-model")) as server:
        scheduler = server.engine.scheduler
        add = scheduler.add

        def encode_then_add(request):
            encode(new_request_message(request, [[1]], request.num_prompt_tokens))
            add(request)

        scheduler.add = encode_then_add
        with httpx.Client(headers=HEADERS, timeout=60) as client:
            before = client.post(url(server, "/v1/completions"), json=GREEDY).json()
            yield server, client, before["choices"][0]["text"]


# -- what a body may hold --------------------------------------------------------------------

texts = st.text(max_size=12)  # every category, lone surrogates (Cs) included
words = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12)
huge_ints = st.one_of(
    st.integers(-(2**80), 2**80), st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**63 - 1])
)
scalars = st.one_of(
    st.none(), st.booleans(), huge_ints, st.integers(-3, 400), texts,
    st.floats(allow_nan=True, allow_infinity=True),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": words | parts}
    ),
    min_size=1, max_size=3,
)  # fmt: skip
# Values each field takes in a well-formed request (a hostile one draws any JSON instead).
COMMON = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 300),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 3),
    "stop": words | st.lists(words, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 299), max_size=3),
    "min_tokens": st.integers(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "cache_salt": words,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
ROUTES = {
    "/v1/completions": (
        COMPLETION,
        {**COMMON, "prompt": words | st.lists(st.integers(0, 299), min_size=1, max_size=5),
         "logprobs": st.integers(0, 5)},
    ),
    "/v1/chat/completions": (
        CHAT,
        {**COMMON, "messages": messages, "logprobs": st.booleans(),
         "top_logprobs": st.integers(0, 5), "add_generation_prompt": st.booleans(),
         "chat_template_kwargs": st.dictionaries(words, words, max_size=2)},
    ),
}  # fmt: skip
# What a hostile body adds: fields nobody (or kvray) knows, another model's name.
HOSTILE = ["model", "echo", "tools", "messages", "prompt", "chat_template_kwargs", "x"]


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """Half the bodies are well formed (so they generate); the other half hold any JSON in
    some fields and may be cut short, not UTF-8, or nested deep."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    base, fields = ROUTES[path]
    body = dict(base)
    hostile = draw(st.booleans())
    for name, values in fields.items():
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(values)
    if not hostile:
        return path, json.dumps(body).encode()
    for name in draw(st.lists(st.sampled_from([*fields, *HOSTILE]), min_size=1, max_size=3)):
        body[name] = draw(json_values)
    escape = draw(st.booleans())  # \ud800 escapes, or surrogates as (invalid) UTF-8 bytes
    raw = json.dumps(body, ensure_ascii=escape).encode("utf-8", "surrogatepass")
    corruption = draw(st.sampled_from(["none"] * 5 + ["cut", "invalid-utf8", "deep"]))
    if corruption == "cut":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif corruption == "invalid-utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + b"\xff\xc3" + raw[at:]
    elif corruption == "deep":
        depth = draw(st.integers(10, 5000))
        raw = raw[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    return path, raw


def read_stream(response: httpx.Response, leave_after: int | None) -> list[str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
            if leave_after is not None and len(events) > leave_after:
                break  # the client goes away mid-stream
    return events


HUGE_SEED = b'{"model": "tiny-chat", "prompt": "hi", "seed": 1' + b"0" * 30 + b"}"


@example(case=("/v1/completions", HUGE_SEED), leave_after=None)
@example(case=("/v1/chat/completions", json.dumps({**CHAT, "stop": ["\ud800"]}).encode()),
         leave_after=None)  # fmt: skip
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=bodies(), leave_after=st.none() | st.integers(0, 2))
def test_random_bodies_get_an_answer_or_an_openai_error(fuzzed, case, leave_after):
    server, client, _ = fuzzed
    path, raw = case
    request = client.build_request("POST", url(server, path), content=raw)
    response = client.send(request, stream=True)
    try:
        if response.status_code != 200:
            response.read()
            error = assert_openai_error(response, response.status_code)
            assert response.status_code in (400, 404), error
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = read_stream(response, leave_after)
            if leave_after is None:
                assert events[-1] == "[DONE]"
                assert not any('"error"' in event[:12] for event in events), events
        else:
            response.read()
            assert response.json()["choices"]
    finally:
        response.close()


def test_after_the_fuzzing_the_server_answers_as_before_and_holds_no_blocks(fuzzed):
    server, client, greedy_before = fuzzed
    stats = wait_until_idle(server)
    assert stats["free"] == stats["usable"] and stats["in_flight"] == 0, stats
    assert stats["rebuilds"] == 0
    assert client.get(url(server, "/health")).status_code == 200
    again = client.post(url(server, "/v1/completions"), json=GREEDY).json()
    assert again["choices"][0]["text"] == greedy_before
