"""Finding the tool calls a model wrote in its own format (``tool_choice: "auto"``), by the
parser ``--tool-call-parser`` names, as vLLM names them:

- ``hermes`` (Hermes 2 Pro, Qwen2.5 and Qwen3, and most chat templates that take tools): each
  call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first
  call is the message's content.
- ``llama3_json`` (Llama 3.1 to 3.3): the whole output is the calls, JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``, optionally after
  ``<|python_tag|>``; an output that does not start so is plain content.

A parser also says, for a stream, how much of the text so far is surely content
(``content_end``): text that could still turn out to begin a call is held back.
"""

from __future__ import annotations

import json
import re

from cluster.tools.forced import ToolCall


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; with no call found, the text is content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows."""
        raise NotImplementedError


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _call(entry, arguments_key: str) -> ToolCall:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError("a tool call needs a name")
    arguments = entry.get(arguments_key, entry.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        json.loads(arguments)
        return ToolCall(entry["name"], arguments)
    return ToolCall(entry["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return _content(text), []
        try:
            calls = [_call(json.loads(body), "arguments") for body in self._CALL.findall(text)]
        except ValueError:  # not JSON, or not a call: the model wrote text after all
            return _content(text), []
        return _content(text[:start]), calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - _longest_prefix_suffix(text, self.START)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return _content(text), []
        decoder, calls, position = json.JSONDecoder(), [], 0
        try:
            while position < len(body):
                entry, position = decoder.raw_decode(body, position)
                calls.append(_call(entry, "parameters"))
                rest = body[position:].lstrip()
                if rest and not rest.startswith(";"):
                    raise ValueError("text after a call")
                position = len(body) - len(rest.lstrip(";").lstrip())
        except ValueError:
            return _content(text), []
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # it may still be (or is) a call: hold it all
        return len(text)


def _longest_prefix_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser)
}
