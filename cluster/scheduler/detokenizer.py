"""Incremental detokenization: text deltas from a growing list of token ids.

Decoding token by token breaks multi-byte characters and words that depend on their
neighbours, so each step decodes a short window of recent tokens and emits only the text that
is new and complete (text ending in U+FFFD is held back until the character completes).
"""

from __future__ import annotations

from workers.tokenizer import Tokenizer

CONTEXT_TOKENS = 6  # tokens of already-emitted context re-decoded for correct joins
# Tokens held back waiting for a character to complete (a UTF-8 character is at most four
# bytes, so four byte tokens). Past this the text goes out as it decodes, replacement
# characters included, so no run of tokens makes each step decode an ever longer window.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the re-decoded context window
        self.read_offset = 0  # tokens already turned into emitted text
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        is_incomplete = full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text)
        if is_incomplete and len(self.token_ids) - self.read_offset < MAX_HELD_TOKENS:
            return ""  # an incomplete character: wait for the next token
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - CONTEXT_TOKENS)
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end, whatever is still held back (replacement characters included)."""
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
