"""The tool-call parsers on outputs in the formats models write (Qwen2.5 / Hermes 2 Pro's
``<tool_call>`` blocks, Llama 3.1's JSON calls), whole and streamed, and forced calls turned
into OpenAI's ``tool_calls``."""

from __future__ import annotations

import json

import pytest

from cluster.tools.forced import parse_required, required_schema
from cluster.tools.output import ToolMode, ToolStream, whole_message
from cluster.tools.parsers import HermesParser, Llama3JsonParser

QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
    'CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
    '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
HERMES_AFTER_TEXT = (
    "Let me look that up.\n<tool_call>\n"
    '{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>'
)
LLAMA_CALL = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
LLAMA_TWO_CALLS = (
    '<|python_tag|>{"name": "search", "parameters": {"query": "kvray"}}; '
    '{"name": "open", "parameters": {"id": 3}}'
)


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_finds_every_call_and_the_content_before():
    content, calls = HermesParser().parse(QWEN_TWO_CALLS)
    assert content is None
    assert calls_of(calls) == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
    ]
    content, calls = HermesParser().parse(HERMES_AFTER_TEXT)
    assert content == "Let me look that up.\n"
    assert calls_of(calls) == [("get_stock_fundamentals", {"symbol": "TSLA"})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild today.",
        '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>',  # not JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    ],
)
def test_hermes_text_without_a_valid_call_is_content(text):
    assert HermesParser().parse(text) == (text, [])


def test_hermes_takes_an_unclosed_last_call():
    """A model that stops right after the JSON (EOS before </tool_call>) still called it."""
    _, calls = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert calls_of(calls) == [("f", {"a": 1})]


def test_llama3_json_calls_with_and_without_python_tag():
    content, calls = Llama3JsonParser().parse(LLAMA_CALL)
    assert content is None
    assert calls_of(calls) == [
        ("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})
    ]
    _, calls = Llama3JsonParser().parse(LLAMA_TWO_CALLS)
    assert calls_of(calls) == [("search", {"query": "kvray"}), ("open", {"id": 3})]


@pytest.mark.parametrize(
    "text",
    ["Paris is the capital of France.", '{"name": "f", "parameters": {}} and then text', "{oops"],
)
def test_llama3_json_other_text_is_content(text):
    assert Llama3JsonParser().parse(text) == (text, [])


def stream(mode: ToolMode, text: str, piece: int = 3, finish_reason: str = "stop"):
    """Feed ``text`` in pieces as a stream would; returns every delta and the finish reason."""
    state, deltas = ToolStream(mode), []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for index, part in enumerate(pieces):
        last = index == len(pieces) - 1
        got, reason = state.feed(part, finish_reason if last else None)
        deltas += got
    return deltas, reason


def test_streamed_hermes_content_flows_and_calls_arrive_whole():
    deltas, reason = stream(ToolMode("auto", parser=HermesParser()), HERMES_AFTER_TEXT)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me look that up.\n"  # never a piece of "<tool_call>"
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_stock_fundamentals"
    assert json.loads(call["function"]["arguments"]) == {"symbol": "TSLA"}
    assert reason == "tool_calls"


def test_streamed_plain_text_is_all_content_even_with_a_partial_marker():
    text = "Use <tool tags> or <tool_ca"
    deltas, reason = stream(ToolMode("auto", parser=HermesParser()), text)
    assert "".join(d["content"] for d in deltas) == text and reason == "stop"


def test_streamed_llama3_holds_a_call_and_releases_text():
    deltas, reason = stream(ToolMode("auto", parser=Llama3JsonParser()), LLAMA_TWO_CALLS)
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 1] and reason == "tool_calls"
    deltas, _ = stream(ToolMode("auto", parser=Llama3JsonParser()), "Hello there")
    assert "".join(d["content"] for d in deltas) == "Hello there"


def test_named_function_streams_its_arguments_as_they_come():
    deltas, reason = stream(ToolMode("named", function="f"), '{"city": "Paris"}', piece=4)
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "f" and first["id"].startswith("call_")
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(arguments) == {"city": "Paris"}
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    assert reason == "stop"  # OpenAI ends a chosen function's call with "stop"


def test_forced_required_calls():
    output = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    message, reason = whole_message(ToolMode("required"), output, "stop")
    assert message["content"] is None and reason == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a", "b"]
    # Cut short by max_tokens: no calls, the text is the content, the reason stays "length".
    message, reason = whole_message(ToolMode("required"), output[:20], "length")
    assert message == {"role": "assistant", "content": output[:20]} and reason == "length"
    assert parse_required("[") is None


def test_required_schema_names_each_tool():
    class Function:
        def __init__(self, name, parameters):
            self.name, self.parameters = name, parameters

    class Tool:
        def __init__(self, name, parameters=None):
            self.function = Function(name, parameters)

    schema = json.loads(required_schema([Tool("a", {"type": "object"}), Tool("b")]))
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["a"], ["b"]]
    assert options[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["minItems"] == 1
