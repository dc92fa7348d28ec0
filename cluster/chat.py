"""A conversation as the model expects it: its chat template rendered (as transformers
renders it) and tokenized without adding special tokens, which the template already wrote.
For the HTTP chat route and gRPC conversations.

Before anything is rendered, every string in the conversation is checked to be text UTF-8 can
encode, and its characters are counted: a conversation whose text alone could not fit the
context is refused at once, whatever the template would make of it. Long conversations are
rendered and tokenized in a worker thread, so the event loop (health checks, other streams)
keeps going.
"""

from __future__ import annotations

import asyncio

from cluster.validation import InvalidRequestError, text_limit
from workers.chat_template import render_chat
from workers.request_limits import RequestFieldError, check_nested_text

INLINE_CHARS = 4096  # longer conversations are rendered and tokenized in a worker thread
# Variables kvray sets itself, which chat_template_kwargs may not replace.
OWN_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})


async def chat_prompt(
    tokenizer,
    messages: list[dict],
    *,
    max_model_len: int,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "This model has no chat template; send a plain prompt to /v1/completions instead."
        )
    template_kwargs = template_kwargs or {}
    num_chars = _checked_chars(messages, template_kwargs)
    limit = text_limit(max_model_len, tokenizer.max_chars_per_token)
    if num_chars > limit:
        raise InvalidRequestError(
            f"The conversation holds {num_chars} characters of text; this model's maximum "
            f"context length of {max_model_len} tokens holds at most {limit}. Shorten it.",
            param="messages",
        )

    def prompt_ids() -> list[int]:
        text = _render(template, tokenizer, messages, add_generation_prompt, template_kwargs)
        if len(text) > limit:
            raise InvalidRequestError(
                f"The conversation renders to {len(text)} characters; this model's maximum "
                f"context length of {max_model_len} tokens holds at most {limit}.",
                param="messages",
            )
        return tokenizer.encode(text, add_special_tokens=False)

    if num_chars > INLINE_CHARS:
        return await asyncio.to_thread(prompt_ids)
    return prompt_ids()


def _checked_chars(messages: list[dict], template_kwargs: dict) -> int:
    """The characters of every string the conversation holds, once each is known to be
    encodable text; the template's own arguments are not the request's to set."""
    taken = sorted(OWN_TEMPLATE_VARIABLES & template_kwargs.keys())
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {taken}: kvray sets them itself (send "
            "add_generation_prompt as a field of the request).",
            param="chat_template_kwargs",
        )
    try:
        check_nested_text(messages, "messages")
        check_nested_text(template_kwargs, "chat_template_kwargs")
    except RequestFieldError as exc:
        raise InvalidRequestError.of(exc) from None
    return _num_chars(messages) + _num_chars(template_kwargs)


def _num_chars(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_num_chars(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_num_chars(item) for item in value)
    return 0


def _render(template, tokenizer, messages, add_generation_prompt, template_kwargs) -> str:
    try:
        return render_chat(
            template,
            messages,
            special_tokens=tokenizer.special_tokens,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except ValueError as exc:
        raise InvalidRequestError(
            f"The conversation does not fit the chat template: {exc}", param="messages"
        ) from None
