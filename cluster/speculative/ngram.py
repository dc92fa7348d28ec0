"""Prompt-lookup drafts: when a request's last few tokens appeared earlier in its own tokens
(prompt or output), propose what followed them there. Text that repeats its context (code
edits, quoting, summaries that copy phrases) gets several tokens per step for free; text that
does not gets no drafts and costs nothing."""

from __future__ import annotations

from collections.abc import Sequence

from workers.speculative_config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.lookup_range

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to ``min(max_drafts, num_speculative_tokens)`` tokens that followed the longest
        earlier match (``min_n`` to ``max_n`` tokens) of the sequence's suffix; the most
        recent match among equally long ones. Empty when nothing matches."""
        limit = min(max_drafts, self.num_speculative_tokens)
        count = len(token_ids)
        if limit <= 0 or count <= self.min_n:
            return []
        last = token_ids[-1]
        best_len, best_end = 0, -1
        # Every earlier position holding the last token ends a candidate match; list.index
        # finds them at C speed, the newest is tried first.
        ends, start = [], 0
        try:
            while True:
                index = token_ids.index(last, start, count - 1)
                ends.append(index)
                start = index + 1
        except ValueError:
            pass
        for end in reversed(ends):
            length = _match_length(token_ids, end, count - 1, min(self.max_n, end + 1))
            if length > best_len:
                best_len, best_end = length, end
                if length == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return list(token_ids[best_end + 1 : best_end + 1 + limit])


def _match_length(tokens: Sequence[int], end: int, suffix_end: int, longest: int) -> int:
    """How many tokens ending at ``end`` equal those ending at ``suffix_end`` (at most
    ``longest``)."""
    length = 0
    while length < longest and tokens[end - length] == tokens[suffix_end - length]:
        length += 1
    return length
