"""Structured outputs and tool calls through the OpenAI API, with the official client, on the
random-weight chat model: whatever the model's (random) preferences, every answer obeys its
constraint, streamed or not; bad constraints are 400s naming the field, and the server keeps
serving with every block back. Preemption and chunked prefill keep each request's matcher in
step with its tokens."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest

from cluster.config import EngineConfig
from cluster.http.protocol import ChatCompletionRequest
from cluster.local import LocalServer
from tests.cluster.chat_model import save_chat_model
from tests.cluster.http_helpers import chat_answer, wait_until_idle
from workers.chat_template import render_chat

MODEL = "tiny-chat"
MESSAGES = [{"role": "user", "content": "hi"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def chat_model_ending_at_im_end(directory):
    """The chat model, its generation config ending only at <|im_end|> (a special token, so
    no EOS text follows the JSON)."""
    save_chat_model(directory)
    generation = directory / "generation_config.json"
    config = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**config, "eos_token_id": 258}))
    return directory


def serve(directory, **settings) -> LocalServer:
    config = EngineConfig(
        model=str(chat_model_ending_at_im_end(directory)),
        kv_cache_memory_bytes=8 << 20,
        port=0,
        http_port=0,
        served_model_name=MODEL,
        tool_call_parser="hermes",
        **{"max_model_len": 256, **settings},
    )
    return LocalServer(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("structured")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.http.address}/v1", api_key="-", max_retries=0)


def json_schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(client, stream):
    for seed in range(3):
        call = dict(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
                    response_format=json_schema_format(PERSON))  # fmt: skip
        text, finish = chat_answer(client, call, stream)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllm_structured_outputs(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=1,
        response_format={"type": "json_object"},
    ).choices[0]  # fmt: skip
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a random model may ramble inside a string: what came is still an object's start
        assert choice.message.content.startswith("{")
    options = ["red", "green", "blue"]
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"choice": options}},
        ).choices[0].message.content  # fmt: skip
        assert answer in options
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    completion = client.completions.create(
        model=MODEL, prompt="code:", max_tokens=12, temperature=1.0, n=3, seed=5,
        extra_body={"structured_outputs": {"regex": pattern}},
    )  # fmt: skip
    assert all(re.fullmatch(pattern, c.text) for c in completion.choices)
    grammar = 'root ::= "(" [a-c]+ ")"'
    text = client.completions.create(
        model=MODEL, prompt="x", max_tokens=10, temperature=1.0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    ).choices[0].text  # fmt: skip
    assert re.fullmatch(r"\([a-c]+\)", text) or re.fullmatch(r"\([a-c]+", text)


def arguments_of(call) -> dict:
    return json.loads(call.function.arguments)


def test_required_and_named_tool_calls_validate(client):
    tools = [WEATHER, CLOCK]
    choice = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=1.0, seed=3,
        tools=tools, tool_choice="required",
    ).choices[0]  # fmt: skip
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        if call.function.name == "get_weather":
            jsonschema.validate(arguments_of(call), WEATHER["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        call = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=4,
                    tools=tools, tool_choice=named)  # fmt: skip
        if stream:
            chunks = [c.choices[0] for c in client.chat.completions.create(**call, stream=True)]
            deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
            assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
            arguments = "".join(d.function.arguments or "" for d in deltas)
            finish = chunks[-1].finish_reason
        else:
            message = client.chat.completions.create(**call).choices[0]
            (tool_call,) = message.message.tool_calls
            arguments, finish = tool_call.function.arguments, message.finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_streamed_required_calls_arrive_as_deltas(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=150, temperature=1.0, seed=3,
        tools=[WEATHER], tool_choice="required", stream=True,
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls and [d.index for d in calls] == list(range(len(calls)))
    for delta in calls:
        jsonschema.validate(json.loads(delta.function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": json_schema_format({"type": "objekt"})}, "response_format",
         'Unsupported type "objekt"'),
        ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
         "response_format", "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(", "choice": ["a"]}}},
         "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex",
         "parenthesis"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope', which is not among"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs",
         "Only one of"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_and_the_server_keeps_serving(server, client, body, param,
                                                               message):  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **body)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert answer.choices[0].finish_reason in ("stop", "length")
    stats = wait_until_idle(server)
    assert stats["free"] == stats["usable"]


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_by_length(client):
    choice = client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "a{10}"}}
    ).choices[0]
    assert choice.finish_reason == "length" and choice.text == "aaaa"


def test_tool_results_render_through_the_chat_template():
    """An assistant turn's calls reach the template with their arguments as objects; the tool's
    answer renders as its role."""
    template = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} "
        "{{ c.function.arguments | tojson }} city={{ c.function.arguments.city }}"
        "{% endfor %}{% else %}{{ m.content }}{% endif %}</{{ m.role }}>{% endfor %}"
        "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
        "| join(',') }}{% endif %}"
    )
    request = ChatCompletionRequest.model_validate({
        "model": MODEL,
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        ],
    })  # fmt: skip
    text = render_chat(template, request.conversation(), special_tokens={},
                       tools=request.template_tools())  # fmt: skip
    assert '<assistant>call get_weather {"city": "Oslo"} city=Oslo</assistant>' in text
    assert "<tool>3 degrees</tool>" in text and text.endswith("tools: get_weather")


def test_preemption_and_chunked_prefill_keep_matchers_in_step(tmp_path):
    """Four constrained requests on a cache that holds about two, prompts prefilled in
    chunks: requests are preempted and resumed, and every answer is still exactly what its
    grammar allows (a matcher out of step would end early, run long, or refuse a token)."""
    pattern = r"[a-z]{40,44}"
    small = serve(
        tmp_path, num_gpu_blocks_override=10, max_model_len=128, max_num_batched_tokens=24
    )
    answers = {}
    with small:
        client = openai.OpenAI(base_url=f"http://{small.http.address}/v1", api_key="-",
                               max_retries=0)  # fmt: skip

        def run(index: int) -> None:
            answers[index] = client.completions.create(
                model=MODEL, prompt=f"request {index}: " + "x" * 40, max_tokens=60,
                temperature=1.0, seed=index, extra_body={"structured_outputs": {"regex": pattern}},
            ).choices[0]  # fmt: skip

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        preemptions = small.run(_preemptions(small))
        stats = wait_until_idle(small)
    assert preemptions > 0
    assert stats["free"] == stats["usable"]
    for index in range(4):
        assert answers[index].finish_reason == "stop"
        assert re.fullmatch(pattern, answers[index].text), answers[index].text


async def _preemptions(server) -> int:
    return server.engine.scheduler.num_preemptions


def test_the_grpc_client_takes_the_same_constraints(server):
    from cluster.client import Client, InvalidRequestError

    with Client(server.address, timeout=60) as grpc_client:
        answer = grpc_client.generate("x", max_tokens=20, temperature=1.0,
                                      structured_outputs={"regex": "[0-9]{4}"})  # fmt: skip
        assert re.fullmatch("[0-9]{4}", answer.text) and answer.finish_reason == "stop"
        answer = grpc_client.generate("x", max_tokens=120, temperature=1.0, seed=2,
                                      structured_outputs={"json": PERSON})  # fmt: skip
        jsonschema.validate(json.loads(answer.text), PERSON)
        answer = grpc_client.generate("x", max_tokens=8, structured_outputs={"choice": ["a", "b"]})
        assert answer.text in ("a", "b")
        with pytest.raises(InvalidRequestError, match="parenthesis"):
            grpc_client.generate("x", max_tokens=8, structured_outputs={"regex": "(x"})
        with pytest.raises(TypeError, match="structured_outputs takes one of"):
            grpc_client.generate("x", structured_outputs={"regex": "a", "grammar": "b"})


def test_auto_tool_calls_are_parsed_from_the_models_own_format(client):
    """tool_choice "auto" with the hermes parser: an answer written in Hermes' format (here
    forced by a regex, since the model is random) comes back as tool_calls, whole and
    streamed, with the text before the call as content."""
    pattern = r'Checking\.<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    call = dict(model=MODEL, messages=MESSAGES, max_tokens=80, tools=[WEATHER, CLOCK],
                extra_body={"structured_outputs": {"regex": pattern}})  # fmt: skip
    choice = client.chat.completions.create(**call).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_time" and json.loads(tool_call.function.arguments) == {}
    chunks = [c.choices[0] for c in client.chat.completions.create(**call, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == "Checking."
    (streamed,) = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert streamed.function.name == "get_time" and streamed.id.startswith("call_")
    assert chunks[-1].finish_reason == "tool_calls"
