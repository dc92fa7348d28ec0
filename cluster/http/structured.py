"""A request's constraint, from whichever field sets it: ``response_format`` (OpenAI),
``structured_outputs`` (vLLM) or a forced ``tool_choice``; at most one may. And how the
request chose tools (``tool_mode``). Refusals name the field at fault, before anything is
scheduled."""

from __future__ import annotations

import json

from cluster.tools.forced import named_schema, required_schema
from cluster.tools.output import ToolMode
from cluster.tools.parsers import TOOL_PARSERS
from cluster.validation import InvalidRequestError
from workers.structured_outputs import StructuredOutputs


def tool_mode(body, parser_name: str | None) -> ToolMode | None:
    """None when the output is plain text (no tools, or ``tool_choice: "none"``)."""
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice needs tools: the request lists none.", param="tool_choice"
            )
        return None
    choice = "auto" if choice is None else choice  # OpenAI's default once there are tools
    if choice == "none":
        return None
    if choice == "auto":
        if parser_name is None:
            raise InvalidRequestError(
                'tool_choice "auto" (the default with tools) needs a server started with '
                f"--tool-call-parser (one of {sorted(TOOL_PARSERS)}); otherwise send "
                'tool_choice "required", a named function, or "none".',
                param="tool_choice",
            )
        return ToolMode("auto", parser=TOOL_PARSERS[parser_name]())
    if choice == "required":
        return ToolMode("required")
    names = [tool.function.name for tool in tools]
    if choice.function.name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {choice.function.name!r}, which is not among "
            f"the request's tools {names}.",
            param="tool_choice",
        )
    return ToolMode("named", function=choice.function.name)


def structured_outputs(body, mode: ToolMode | None) -> tuple[StructuredOutputs | None, str]:
    """The request's constraint and the field it came from."""
    found = []
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _from_response_format(response_format)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_body(body.structured_outputs)))
    if mode is not None and mode.kind in ("required", "named"):
        found.append(("tool_choice", _from_tool_choice(body, mode)))
    if len(found) > 1:
        raise InvalidRequestError(
            f"Only one of response_format, structured_outputs and a forced tool_choice may "
            f"constrain the output; this request sets {[name for name, _ in found]}.",
            param=found[1][0],
        )
    if not found:
        return None, ""
    return found[0][1], found[0][0]


def _from_response_format(response_format) -> StructuredOutputs:
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise InvalidRequestError(
            'response_format of type "json_schema" needs json_schema.schema.',
            param="response_format",
        )
    return StructuredOutputs(json=json.dumps(spec.json_schema))


def _from_body(body) -> StructuredOutputs:
    value = body.json_
    return StructuredOutputs(
        json=value if isinstance(value, str) or value is None else json.dumps(value),
        json_object=bool(body.json_object),
        regex=body.regex,
        choice=None if body.choice is None else tuple(body.choice),
        grammar=body.grammar,
    )


def _from_tool_choice(body, mode: ToolMode) -> StructuredOutputs:
    if mode.kind == "required":
        return StructuredOutputs(json=required_schema(body.tools))
    function = next(t.function for t in body.tools if t.function.name == mode.function)
    return StructuredOutputs(json=named_schema(function))
