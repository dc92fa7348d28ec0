"""OpenAI response bodies and stream chunks, for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid

from cluster.http.choices import Choice
from cluster.tools.output import ToolMode, ToolStream, whole_message
from workers.protocol import TokenLogprobs


class ResponseWriter:
    """Formats one request's responses: its id, creation time and model are shared by every
    chunk, as OpenAI's are."""

    def __init__(self, kind: str, model: str, tokenizer, tool_mode: ToolMode | None = None):
        self.is_chat = kind == "chat"
        self.tool_mode = tool_mode  # how a chat's text becomes tool calls; None: it does not
        self._tool_streams: dict[int, ToolStream] = {}
        prefix = "chatcmpl" if self.is_chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.object = "chat.completion" if self.is_chat else "text_completion"

    # -- whole responses ---------------------------------------------------------------------

    def response(self, choices: list[Choice], n: int) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(choice) for choice in choices],
            "usage": usage(choices, n),
        }

    def _choice(self, choice: Choice) -> dict:
        logprobs = self.logprobs(choice.token_ids, choice.logprobs) if choice.logprobs else None
        body = {"index": choice.index, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        if self.is_chat and self.tool_mode is not None:
            message, finish_reason = whole_message(
                self.tool_mode, choice.text, choice.finish_reason
            )
            body |= {"message": message, "finish_reason": finish_reason}
        elif self.is_chat:
            body["message"] = {"role": "assistant", "content": choice.text}
        else:
            body["text"] = choice.text
        return body

    # -- streams -----------------------------------------------------------------------------

    def chunk(self, index: int, text: str, token_ids, logprobs, finish_reason, first: bool):
        if self.is_chat and self.tool_mode is not None:
            return self._tool_chunks(index, text, token_ids, logprobs, finish_reason)
        body = {"index": index, "finish_reason": finish_reason}
        if logprobs:
            body["logprobs"] = self.logprobs(token_ids, logprobs)
        if self.is_chat:
            body["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            body["text"] = text
        return self._event({"choices": [body]})

    def _tool_chunks(self, index: int, text: str, token_ids, logprobs, finish_reason) -> str:
        """The events one output gives when text may become tool calls: none while the text
        is held back, several when calls complete at once. Log-probabilities ride on the
        first event (on an empty delta, when the text is held)."""
        stream = self._tool_streams.setdefault(index, ToolStream(self.tool_mode))
        deltas, finish_reason = stream.feed(text, finish_reason)
        if not deltas and (finish_reason is not None or logprobs):
            deltas = [{}]
        events = []
        for position, delta in enumerate(deltas):
            if not stream.role_sent:
                delta, stream.role_sent = {"role": "assistant", **delta}, True
            last = position == len(deltas) - 1
            body = {
                "index": index,
                "delta": delta,
                "finish_reason": finish_reason if last else None,
            }
            if logprobs and position == 0:
                body["logprobs"] = self.logprobs(token_ids, logprobs)
            events.append(self._event({"choices": [body]}))
        return "".join(events)

    def usage_chunk(self, choices: list[Choice], n: int) -> str:
        return self._event({"choices": [], "usage": usage(choices, n)})

    def _event(self, body: dict) -> str:
        chunk_object = "chat.completion.chunk" if self.is_chat else "text_completion"
        head = {"id": self.id, "object": chunk_object, "created": self.created}
        return sse({**head, "model": self.model, **body})

    # -- log-probabilities -------------------------------------------------------------------

    def logprobs(self, token_ids: list[int], entries: list[TokenLogprobs]) -> dict:
        if self.is_chat:
            return {
                "content": [
                    {
                        **self._token(token, entry.logprob),
                        "top_logprobs": [self._token(t, value) for t, value in entry.top],
                    }
                    for token, entry in zip(token_ids, entries, strict=True)
                ]
            }
        texts = [self.tokenizer.decode([token]) for token in token_ids]
        offsets, offset = [], 0
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [
                {self.tokenizer.decode([t]): value for t, value in entry.top} for entry in entries
            ],
            "text_offset": offsets,
        }

    def _token(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of all."""
    prompt = sum(choice.prompt_tokens for choice in choices[::n])
    completion = sum(len(choice.token_ids) for choice in choices)
    cached = sum(choice.cached_tokens for choice in choices[::n])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(body: dict | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return f"data: {data}\n\n"
