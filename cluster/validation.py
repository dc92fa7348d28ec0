"""Request checks that need the model: prompt size, token ids, text, and output room. Each
refusal says what is allowed. The limits of every integer and text field are one table
(``workers.request_limits``); these run in the engine before anything is scheduled, once for
every front end."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from workers.request_limits import ModelLimits, RequestFieldError
from workers.request_limits import check_text as _check_text
from workers.request_limits import check_token_ids as _check_token_ids
from workers.sampling import DEFAULT_MAX_TOKENS, SamplingParams


class InvalidRequestError(ValueError):
    """The request is malformed; nothing was scheduled. ``param`` names the field at fault,
    when there is one (OpenAI error bodies carry it)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param

    @classmethod
    def of(cls, error: RequestFieldError) -> InvalidRequestError:
        return cls(str(error), param=error.field)


def check_text(value: object, field: str) -> None:
    try:
        _check_text(value, field)
    except RequestFieldError as exc:
        raise InvalidRequestError.of(exc) from None


def text_limit(max_model_len: int, max_chars_per_token: int) -> int:
    """The most characters a text can have and still fit: no token spans more than
    ``max_chars_per_token`` characters."""
    return (max_model_len - 1) * max_chars_per_token


def check_prompt_text(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    """Refuse a text prompt that cannot fit however it tokenizes, or that is not text UTF-8
    can encode, before tokenizing it."""
    limit = text_limit(max_model_len, max_chars_per_token)
    if len(text) > limit:
        raise InvalidRequestError(
            f"The prompt has {len(text)} characters; this model's maximum context length of "
            f"{max_model_len} tokens holds at most {limit}. Shorten the prompt.",
            param="prompt",
        )
    check_text(text, "prompt")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    try:
        _check_token_ids(token_ids, ModelLimits(vocab_size=vocab_size), field)
    except RequestFieldError as exc:
        raise InvalidRequestError.of(exc) from None


def check_prompt_len(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise InvalidRequestError("The prompt is empty; give at least one token.", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"The prompt has {num_prompt_tokens} tokens, but this model allows at most "
            f"{max_model_len - 1} (max_model_len {max_model_len}, with room for one output "
            "token).",
            param="prompt",
        )


def resolve_max_tokens(
    sampling: SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """An unset ``max_tokens`` becomes the default (or ``min_tokens``, when more), clipped to
    the room the prompt leaves; a given one that does not fit is refused (as OpenAI and vLLM
    do), with the numbers."""
    room = max_model_len - num_prompt_tokens
    if sampling.min_tokens > room:
        raise InvalidRequestError(
            f"min_tokens is {sampling.min_tokens}, but the prompt's {num_prompt_tokens} tokens "
            f"leave room for {room} output tokens in this model's maximum context length of "
            f"{max_model_len}.",
            param="min_tokens",
        )
    if sampling.max_tokens is None:
        default = min(max(DEFAULT_MAX_TOKENS, sampling.min_tokens), room)
        return msgspec.structs.replace(sampling, max_tokens=default)
    if sampling.max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {sampling.max_tokens} output tokens and your prompt contains "
            f"{num_prompt_tokens} input tokens, for a total of "
            f"{sampling.max_tokens + num_prompt_tokens} tokens. Ask for at most {room} output "
            "tokens or shorten the prompt.",
            param="max_tokens",
        )
    return sampling
