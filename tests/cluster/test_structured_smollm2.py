"""Structured outputs on a real trained model, SmolLM2-135M-Instruct (``embedded:smollm2``),
through the official openai client: JSON-schema answers at temperature 1 parse and validate
for several seeds, streamed and not; JSON objects parse; forced tool calls validate against
their function's parameters; choices and regexes hold; an invalid schema is a 400 and the
server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.cluster.http_helpers import chat_answer, wait_until_idle

MODEL = "smollm2"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON: name, age and hobbies."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(
        model="embedded:smollm2",
        kv_cache_memory_bytes=64 << 20,
        port=0,
        http_port=0,
        max_model_len=1024,
        served_model_name=MODEL,
    )
    with LocalServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.http.address}/v1", api_key="-", max_retries=0)


def test_json_schema_answers_validate_for_several_seeds(client):
    for seed, stream in ((0, False), (1, False), (2, True)):
        call = dict(model=MODEL, messages=ASK_PERSON, max_tokens=200, temperature=1.0,
                    seed=seed, response_format={"type": "json_schema", "json_schema": {
                        "name": "person", "schema": PERSON, "strict": True}})  # fmt: skip
        text, finish = chat_answer(client, call, stream)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_answers_parse(client):
    # Sampled at temperature 1, a small model may still be inside a string at max_tokens (the
    # grammar allows any object): every answer that ends must parse, and most end (4 of these
    # 5). Five seeds, so that a change in the arithmetic's last bit, which moves every sample,
    # cannot turn the test by moving one answer past its length.
    choices = [
        client.chat.completions.create(
            model=MODEL, messages=ASK_PERSON, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_object"},
        ).choices[0]
        for seed in (3, 4, 5, 6, 7)
    ]  # fmt: skip
    finished = [c for c in choices if c.finish_reason == "stop"]
    assert len(finished) >= 2, [c.message.content for c in choices]
    assert all(c.finish_reason in ("stop", "length") for c in choices)
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)


def test_forced_tool_calls_validate(client):
    parameters = WEATHER["function"]["parameters"]
    required = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=100, temperature=1.0, seed=1,
        tools=[WEATHER], tool_choice="required",
    ).choices[0]  # fmt: skip
    assert required.finish_reason == "tool_calls"
    assert required.message.tool_calls
    for call in required.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    named = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=100, temperature=1.0, seed=2,
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]  # fmt: skip
    (call,) = named.message.tool_calls
    assert call.function.name == "get_weather" and named.finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_choice_and_regex(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}],
        max_tokens=5, temperature=1.0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    ).choices[0].message.content  # fmt: skip
    assert answer in ("yes", "no")
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a US phone number."}],
        max_tokens=20, temperature=1.0, extra_body={"structured_outputs": {"regex": pattern}},
    ).choices[0].message.content  # fmt: skip
    assert re.fullmatch(pattern, answer)


def test_invalid_schema_is_a_400_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError, match="objekt"):
        client.chat.completions.create(
            model=MODEL, messages=ASK_PERSON, max_tokens=10,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "objekt"}}},
        )  # fmt: skip
    answer = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5)
    assert answer.choices[0].message.content
    stats = wait_until_idle(server)
    assert stats["free"] == stats["usable"]
