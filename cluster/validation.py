"""Request checks that need the model: prompt size, token ids, and output room. Each refusal
says what is allowed. Sampling fields check themselves (``workers.sampling``); these run in the
engine before anything is scheduled, once for every front end."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from workers.sampling import DEFAULT_MAX_TOKENS, SamplingParams


class InvalidRequestError(ValueError):
    """The request is malformed; nothing was scheduled."""


def check_prompt_text(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    """Refuse a text prompt that cannot fit however it tokenizes, before tokenizing it: no
    token spans more than ``max_chars_per_token`` characters."""
    limit = (max_model_len - 1) * max_chars_per_token
    if len(text) > limit:
        raise InvalidRequestError(
            f"The prompt has {len(text)} characters; this model's maximum context length of "
            f"{max_model_len} tokens holds at most {limit}. Shorten the prompt."
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{what} must be in [0, {vocab_size}); got {bad[:5]}")


def check_prompt_len(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise InvalidRequestError("The prompt is empty; give at least one token.")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"The prompt has {num_prompt_tokens} tokens, but this model allows at most "
            f"{max_model_len - 1} (max_model_len {max_model_len}, with room for one output "
            "token)."
        )


def resolve_max_tokens(
    sampling: SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """An unset ``max_tokens`` becomes the default, clipped to the room the prompt leaves; a
    given one that does not fit is refused (as OpenAI and vLLM do), with the numbers."""
    room = max_model_len - num_prompt_tokens
    if sampling.max_tokens is None:
        return msgspec.structs.replace(sampling, max_tokens=min(DEFAULT_MAX_TOKENS, room))
    if sampling.max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {sampling.max_tokens} output tokens and your prompt contains "
            f"{num_prompt_tokens} input tokens, for a total of "
            f"{sampling.max_tokens + num_prompt_tokens} tokens. Ask for at most {room} output "
            "tokens or shorten the prompt."
        )
    return sampling
