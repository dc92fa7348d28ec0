"""Incremental detokenization: text deltas from a growing list of token ids.

Decoding token by token breaks multi-byte characters and words that depend on their
neighbours, so each step decodes a short window of recent tokens and emits only the text that
is new and complete (text ending in U+FFFD is held back until the character completes).
The last prompt tokens start the window, because tokenizers render a token from its context:
SentencePiece's "▁Paris" decodes to "Paris" at the start of a text and to " Paris" after one.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.tokenizer import Tokenizer

CONTEXT_TOKENS = 6  # tokens of already-emitted context re-decoded for correct joins
# Tokens held back waiting for a character to complete (a UTF-8 character is at most four
# bytes, so four byte tokens). Past this the text goes out as it decodes, replacement
# characters included, so no run of tokens makes each step decode an ever longer window.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()):
        """``prompt_token_ids``: the prompt (only its last CONTEXT_TOKENS are kept), so the
        first text is what decoding prompt and output together adds to the prompt's text."""
        self.tokenizer = tokenizer
        # The prompt's tail (context, never emitted), then the output.
        self.token_ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.read_offset = len(self.token_ids)  # tokens already turned into emitted text
        self.prefix_offset = self._character_start(0)  # start of the re-decoded window
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        end = len(self.token_ids)
        full_text = self._decode(self.prefix_offset, end)
        if _is_incomplete(full_text, prefix_text):
            if end - self.read_offset < MAX_HELD_TOKENS:
                return ""  # an incomplete character: wait for the next token
            # Held too long: let out the text that is complete, or else all of it.
            end, full_text = self._last_complete(prefix_text) or (end, full_text)
        return self._emit(end, full_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end, whatever is still held back (replacement characters included)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        return self._emit(len(self.token_ids), delta)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end])

    def _emit(self, end: int, delta: str) -> str:
        """``delta`` is the text of the tokens up to ``end``; the next window starts at most
        CONTEXT_TOKENS back."""
        read_offset, self.read_offset = self.read_offset, end
        start = max(read_offset, end - CONTEXT_TOKENS)
        # The old read offset ends complete text; a later start may cut a character.
        self.prefix_offset = start if start == read_offset else self._character_start(start)
        self.text += delta
        return delta

    def _character_start(self, start: int) -> int:
        """The first offset from ``start`` where the context decodes without a cut character
        in front: a byte-fallback decoder (SentencePiece's) renders a whole run of byte tokens
        as replacement characters when it starts mid-character, the new tokens' too."""
        while start < self.read_offset:
            if not self._decode(start, self.read_offset).startswith("\ufffd"):
                break
            start += 1
        return start

    def _last_complete(self, prefix_text: str) -> tuple[int, str] | None:
        """The longest run of held tokens whose text adds complete characters, and that text."""
        for end in range(len(self.token_ids) - 1, self.read_offset, -1):
            text = self._decode(self.prefix_offset, end)
            if not _is_incomplete(text, prefix_text):
                return end, text
        return None


def _is_incomplete(full_text: str, prefix_text: str) -> bool:
    return full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text)
