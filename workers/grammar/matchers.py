"""One xgrammar matcher per constrained request, on the rank that samples.

A request's compiled grammar arrives once, with its first step (``add``); the matcher is made
when it first samples. Before each fill, a matcher is brought in line with the tokens this
rank holds for the request (``_sync``): tokens it has not seen are accepted, and when the
request holds fewer than the matcher took in (tokens a step sampled that the request no
longer has) it rolls back. So preemption, resumption and chunked prefill cannot leave a
matcher out of step with its request, and a step that discards samples (speculative decoding,
later) only has to shorten the request's tokens.

Once a matcher has accepted a stop token it is terminated: the controller ends the request at
that token, and a step already sent for it samples unconstrained (its token is dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.grammar.bitmask import bitmask_width

logger = logging.getLogger(__name__)


@dataclass
class _State:
    matcher: object  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has taken in
    failed: bool = False  # it refused a sampled token: the request is failed, not masked


class GrammarMatchers:
    def __init__(self, vocabulary: Callable[[], object]):
        self._make_vocabulary = vocabulary  # -> xgrammar.TokenizerInfo, made at first use
        self._vocabulary = None
        self._pending: dict[str, bytes] = {}  # compiled grammars not yet made into matchers
        self._states: dict[str, _State] = {}
        self._failed_in_sync: list[str] = []  # reported with the next accept()

    def add(self, request_id: str, grammar: bytes) -> None:
        """A request's compiled grammar (``CompiledGrammar.serialize_json``), sent with its
        first step; a resumed request keeps its matcher."""
        if request_id not in self._states:
            self._pending[request_id] = grammar

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._pending

    def __len__(self) -> int:
        return len(self._states) + len(self._pending)

    @property
    def vocab_size(self) -> int:
        return self._vocabulary_info().vocab_size

    def masks(
        self, rows: Sequence[tuple[str, Sequence[int]]]
    ) -> tuple[list[int], torch.Tensor] | None:
        """For rows (request id, its output tokens so far) of a step: the indices of the
        rows to constrain and their int32 bitmasks ``[C, W]`` (on the CPU), or None when no
        row is constrained now."""
        indices, states = [], []
        for index, (request_id, output_ids) in enumerate(rows):
            state = self._state(request_id)
            if state is None:
                continue
            self._sync(request_id, state, output_ids)
            if not (state.failed or state.matcher.is_terminated()):
                indices.append(index)
                states.append(state)
        if not indices:
            return None
        vocab_size = self.vocab_size
        bitmask = torch.empty((len(states), bitmask_width(vocab_size)), dtype=torch.int32)
        for position, state in enumerate(states):
            state.matcher.fill_next_token_bitmask(bitmask, position)
        return indices, bitmask

    def accept(self, request_ids: Sequence[str], tokens: Sequence[int]) -> list[str]:
        """Advance the constrained rows' matchers by their sampled tokens; returns the ids of
        requests whose matcher refused its token (the mask allowed nothing else)."""
        refused, self._failed_in_sync = self._failed_in_sync, []
        for request_id, token in zip(request_ids, tokens, strict=True):
            state = self._states.get(request_id)
            if state is None or state.failed or state.matcher.is_terminated():
                continue
            if state.matcher.accept_token(token):
                state.num_accepted += 1
            else:
                state.failed = True
                refused.append(request_id)
        return refused

    def _state(self, request_id: str) -> _State | None:
        state = self._states.get(request_id)
        if state is None and request_id in self._pending:
            import xgrammar

            compiled = xgrammar.CompiledGrammar.deserialize_json(
                self._pending.pop(request_id).decode(), self._vocabulary_info()
            )
            state = self._states[request_id] = _State(xgrammar.GrammarMatcher(compiled))
        return state

    def _sync(self, request_id: str, state: _State, output_ids: Sequence[int]) -> None:
        if state.failed:
            return
        matcher = state.matcher
        if len(output_ids) < state.num_accepted:
            try:
                matcher.rollback(state.num_accepted - len(output_ids))
                state.num_accepted = len(output_ids)
            except Exception:  # beyond its history: start again from the first token
                matcher.reset()
                state.num_accepted = 0
        while state.num_accepted < len(output_ids) and not matcher.is_terminated():
            if not matcher.accept_token(output_ids[state.num_accepted]):
                logger.error("Request %s holds a token its grammar refuses", request_id)
                state.failed = True
                self._failed_in_sync.append(request_id)
                return
            state.num_accepted += 1

    def _vocabulary_info(self):
        if self._vocabulary is None:
            self._vocabulary = self._make_vocabulary()
        return self._vocabulary
