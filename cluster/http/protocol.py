"""The OpenAI request bodies kvray reads, and how they turn into engine sampling fields.

Fields kvray does not implement are refused by name when a request sets them (``logit_bias``,
``suffix``, ``echo``, the deprecated ``functions``), never ignored in silence; fields the
OpenAI clients send with neutral values (``user``, ``stream_options: null``...) pass.
Non-OpenAI sampling fields (``top_k``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``) and vLLM's ``structured_outputs`` arrive as extra body
fields, as with vLLM. ``response_format``, ``structured_outputs`` and forced tool calls become
one ``StructuredOutputs`` (``cluster.http.structured``).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.validation import InvalidRequestError
from workers.request_limits import MAX_LOGPROBS

MAX_N = 16  # choices per request: each is a full generation
MAX_PROMPTS = 2048  # prompts in one completions request, as OpenAI allows


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # kvray always enforces the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send more; the unsupported are named

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None

    UNSUPPORTED: frozenset[str] = frozenset()

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        named = [k for k in self.UNSUPPORTED if extra.get(k) not in (None, False, [], {})]
        if named:
            raise InvalidRequestError(f"kvray does not support {sorted(named)} in this endpoint")

    def sampling_fields(self, logprobs: int | None) -> dict[str, Any]:
        """The engine's sampling fields this request sets (unset ones take the defaults)."""
        fields = {
            name: getattr(self, name)
            for name in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                         "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "min_tokens", "ignore_eos")
            if getattr(self, name) is not None
        }  # fmt: skip
        if self.stop is not None:
            fields["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            fields["stop_token_ids"] = tuple(self.stop_token_ids)
        if logprobs is not None:
            fields["logprobs"] = logprobs
        return fields

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    UNSUPPORTED: frozenset[str] = frozenset({"suffix", "echo", "logit_bias", "best_of"})

    def prompts(self) -> list[str | list[int]]:
        """One or more prompts: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed",
                param="prompt",
            )
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, reasoning...

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # kvray enforces the parameters when it forces a call


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # every parser returns all the calls it finds

    UNSUPPORTED: frozenset[str] = frozenset({"functions", "function_call", "logit_bias"})

    def sampling_fields(self, logprobs: int | None = None) -> dict[str, Any]:
        fields = super().sampling_fields((self.top_logprobs or 0) if self.logprobs else None)
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        return fields

    def conversation(self) -> list[dict[str, Any]]:
        return [_for_template(message.model_dump(exclude_none=True)) for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's form, as transformers passes it)."""
        return [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools or ()]


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls carry their arguments as JSON text; templates read them
    as objects (``tool_call.arguments | tojson``, ``.items()``), as vLLM passes them."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
        converted.append(call)
    return {**message, "tool_calls": converted}
