"""Turning what a front end received into an engine request, or refusing it before anything
is scheduled: sampling fields over the model's defaults, checked against the shared table of
field limits (``workers.request_limits``) with this model's vocabulary and context; the prompt
checked as text, tokenized (long prompts off the event loop, so health checks and other
streams keep going) and checked against the model's limits."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence

import msgspec

from cluster.output.detokenizer import IncrementalDetokenizer
from cluster.scheduler.request import EngineRequest
from cluster.structured.compiler import GrammarCompiler
from cluster.validation import (
    InvalidRequestError,
    check_prompt_len,
    check_prompt_text,
    check_text,
    check_token_ids,
    resolve_max_tokens,
)
from kvcore.kv_request import KVRequest
from workers.request_limits import ModelLimits, RequestFieldError, check_sampling_fields
from workers.sampling import SamplingParams
from workers.tokenizer import Tokenizer

INLINE_TOKENIZE_CHARS = 4096  # longer text prompts are tokenized in a worker thread


class AdmittedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request that passed every check, before it is anything an engine holds: what an
    ingress sends to the engine replica it routes the request to."""

    request_id: str
    token_ids: list[int]  # the prompt
    sampling: SamplingParams  # max_tokens resolved
    cache_salt: str | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids


class Admission:
    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = ModelLimits(vocab_size=vocab_size, max_model_len=max_model_len)
        self.default_sampling: dict = {}  # the model's generation defaults, by field name
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        self._arrivals = itertools.count()

    def sampling_params(self, fields: dict) -> SamplingParams:
        """A request's sampling: the fields it sets over the model's defaults (its
        generation_config.json), checked; InvalidRequestError with what is allowed otherwise."""
        merged = {**self.default_sampling, **fields}
        try:
            check_sampling_fields(merged, self.limits)
            return SamplingParams(**merged)
        except RequestFieldError as exc:
            raise InvalidRequestError.of(exc) from None
        except (ValueError, TypeError) as exc:  # an unknown field, a value of the wrong type
            raise InvalidRequestError(str(exc)) from None

    async def admit(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        request_id: str | None,
        *,
        cache_salt: str | None,
    ) -> AdmittedRequest:
        """A checked request. ``cache_salt`` confines its prefix-cache hits to requests with
        the same salt (a tenant's own). A constrained request's grammar is compiled (or found
        in the cache) here, so one that does not compile is refused before it is sent."""
        admitted, _ = await self._admit(prompt, sampling, request_id, cache_salt=cache_salt)
        return admitted

    async def _admit(
        self, prompt, sampling: SamplingParams, request_id: str | None, *, cache_salt: str | None
    ) -> tuple[AdmittedRequest, bytes | None]:
        for field, text in (("request_id", request_id), ("cache_salt", cache_salt)):
            if text is not None:
                check_text(text, field)
        token_ids = await self._token_ids(prompt)
        check_prompt_len(len(token_ids), self.max_model_len)
        grammar = None
        if sampling.structured_outputs is not None:
            grammar = await self.grammars.compile(sampling.structured_outputs)
        admitted = AdmittedRequest(
            request_id=request_id or uuid.uuid4().hex,
            token_ids=token_ids,
            sampling=resolve_max_tokens(sampling, len(token_ids), self.max_model_len),
            cache_salt=cache_salt,
        )
        return admitted, grammar

    async def request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        request_id: str | None,
        *,
        cache_salt: str | None,
        hash_block_size: int,
    ) -> EngineRequest:
        """A checked request, as the engine holds it (see ``admit``)."""
        admitted, grammar = await self._admit(prompt, sampling, request_id, cache_salt=cache_salt)
        kv = KVRequest(
            admitted.request_id,
            admitted.token_ids,
            hash_block_size=hash_block_size,
            cache_salt=cache_salt,
        )
        return EngineRequest(
            request_id=admitted.request_id,
            kv=kv,
            sampling=admitted.sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer, admitted.token_ids),
            arrival_index=next(self._arrivals),
            grammar=grammar,
        )

    async def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            token_ids = list(prompt)
            check_token_ids(token_ids, self.vocab_size)
            return token_ids
        check_prompt_text(prompt, self.max_model_len, self.tokenizer.max_chars_per_token)
        try:
            if len(prompt) > INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(self.tokenizer.encode, prompt)
            return self.tokenizer.encode(prompt)
        except ValueError as exc:  # a model without a tokenizer says to send token ids
            raise InvalidRequestError(str(exc)) from None
