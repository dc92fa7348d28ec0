"""A conversation as the model expects it: its chat template rendered (as transformers
renders it) and tokenized without adding special tokens, which the template already wrote.
For the HTTP chat route and ``kvray chat``."""

from __future__ import annotations

import asyncio

from cluster.validation import InvalidRequestError
from workers.chat_template import render_chat

INLINE_CHARS = 4096  # longer renderings are tokenized in a worker thread


async def chat_prompt(
    tokenizer,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "This model has no chat template; send a plain prompt to /v1/completions instead."
        )
    try:
        text = render_chat(
            template,
            messages,
            special_tokens=tokenizer.special_tokens,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except ValueError as exc:
        message = f"The conversation does not fit the chat template: {exc}"
        raise InvalidRequestError(message) from None
    if len(text) > INLINE_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)
