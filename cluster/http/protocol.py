"""The OpenAI request bodies kvray reads, and how they turn into engine sampling fields.

Fields kvray does not implement are refused by name when a request sets them (``tools``,
``response_format``, ``logit_bias``, ``suffix``, ``echo``), never ignored in silence; fields
the OpenAI clients send with neutral values (``user``, ``stream_options: null``...) pass.
Non-OpenAI sampling fields (``top_k``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``) arrive as extra body fields, as with vLLM.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.validation import InvalidRequestError
from workers.request_limits import MAX_LOGPROBS

MAX_N = 16  # choices per request: each is a full generation
MAX_PROMPTS = 2048  # prompts in one completions request, as OpenAI allows


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    UNSUPPORTED: frozenset[str] = frozenset(
        {"tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias"}
    )

    def sampling_fields(self, logprobs: int | None = None) -> dict[str, Any]:
        fields = super().sampling_fields((self.top_logprobs or 0) if self.logprobs else None)
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        return fields

    def conversation(self) -> list[dict[str, Any]]:
        return [message.model_dump(exclude_none=True) for message in self.messages]
