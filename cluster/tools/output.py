"""A chat choice's text as OpenAI's assistant message: plain content, or ``tool_calls``, by
how the request chose tools (``ToolMode``). Whole, for a response; or as stream deltas, where
content flows as it comes and calls go out once whole (the parser has seen their closing
text), each as one delta holding its id, name and complete arguments, which the OpenAI
clients accumulate like any other. A named function's arguments stream as they come, since
nothing else can be in that output."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from cluster.tools.forced import ToolCall, parse_required
from cluster.tools.parsers import ToolParser


@dataclass(frozen=True)
class ToolMode:
    kind: str  # "auto" (a parser finds calls), "required", or "named"
    parser: ToolParser | None = None  # for "auto"
    function: str | None = None  # for "named"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_body(call: ToolCall, index: int | None = None) -> dict:
    body = {"id": call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    return body if index is None else {"index": index, **body}


def whole_message(mode: ToolMode, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(the assistant message, the choice's finish reason) of a finished choice."""
    content, calls = _parsed(mode, text)
    message = {"role": "assistant", "content": content}
    if not calls:
        return message, finish_reason
    message["tool_calls"] = [tool_call_body(call) for call in calls]
    return message, _finish_reason(mode, finish_reason)


def _parsed(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    if mode.kind == "named":
        return None, [ToolCall(mode.function, text)]
    if mode.kind == "required":
        calls = parse_required(text)
        return (text, []) if calls is None else (None, calls)
    return mode.parser.parse(text)


def _finish_reason(mode: ToolMode, finish_reason: str | None) -> str | None:
    """OpenAI ends a choice that called tools with "tool_calls", but a call to a named
    function with "stop" (the caller chose it); a choice cut short keeps "length"."""
    if mode.kind == "named" or finish_reason != "stop":
        return finish_reason
    return "tool_calls"


@dataclass
class ToolStream:
    """One choice's deltas as its text arrives."""

    mode: ToolMode
    text: str = ""
    emitted: int = 0  # characters of text already sent as content (or named arguments)
    named_id: str | None = None
    role_sent: bool = False  # the first delta of a chat choice names the assistant role

    def feed(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas this text (and, once finished, the end) gives, and the finish reason
        the closing chunk carries."""
        self.text += text
        if self.mode.kind == "named":
            return self._named(), finish_reason
        if finish_reason is None:
            if self.mode.kind == "auto":
                return self._content_up_to(self.mode.parser.content_end(self.text)), None
            return [], None  # "required": one array, known once whole
        content, calls = _parsed(self.mode, self.text)
        if not calls:
            return self._content_up_to(len(self.text)), finish_reason
        # The parser's content is a prefix of the text: it ends where the content does.
        deltas = self._content_up_to(0 if content is None else len(content))
        deltas += [{"tool_calls": [tool_call_body(call, i)]} for i, call in enumerate(calls)]
        return deltas, _finish_reason(self.mode, finish_reason)

    def _named(self) -> list[dict]:
        arguments, self.emitted = self.text[self.emitted :], len(self.text)
        if self.named_id is None:
            self.named_id = call_id()
            function = {"name": self.mode.function, "arguments": arguments}
            return [{"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                     "function": function}]}]  # fmt: skip
        if not arguments:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}]

    def _content_up_to(self, end: int) -> list[dict]:
        if end <= self.emitted:
            return []
        content, self.emitted = self.text[self.emitted : end], end
        return [{"content": content}]
