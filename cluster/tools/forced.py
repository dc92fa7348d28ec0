"""``tool_choice`` as a constraint. A named function forces its arguments: the output is one
JSON value matching the function's ``parameters``. ``"required"`` forces one or more calls,
written as a JSON array of ``{"name": ..., "parameters": ...}`` objects, each naming one of the
request's tools with arguments matching that tool's parameters (vLLM writes forced calls the
same way)."""

from __future__ import annotations

import json
from dataclasses import dataclass

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def parameters_of(function) -> dict:
    """A function's parameter schema (``None`` in the request: it takes no arguments)."""
    return function.parameters if function.parameters is not None else EMPTY_PARAMETERS


def named_schema(function) -> str:
    return json.dumps(parameters_of(function))


def required_schema(tools) -> str:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": parameters_of(tool.function),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return json.dumps({"type": "array", "items": item, "minItems": 1})


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls a forced ``"required"`` output holds; None when it is not a whole array of
    calls (the output ran out of tokens)."""
    try:
        calls = json.loads(text)
        return [
            ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in calls
        ]
    except (ValueError, TypeError, KeyError):
        return None
