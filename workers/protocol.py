"""The controller <-> worker messages: the plan of one engine step and the worker's reply,
with the log-probabilities a reply carries. Plain msgspec structs and no torch, so the
scheduler, the engine and the client load this without loading a model's dependencies;
``SamplingParams`` (``workers.sampling``) travels inside them.

New requests arrive once, with everything a worker must remember; after that only deltas
travel: the blocks added since the last step and how many tokens to compute now. Workers never
see the block pool or the scheduler's request objects. Both structs are msgspec messages, so
the transport can change (actor call, compiled graph, shared memory) without touching either
side.
"""

from __future__ import annotations

import msgspec

from workers.sampling import SamplingParams


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log-probability and the ``logprobs`` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


class NewRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    # Every token known so far: the prompt, plus the outputs when a preempted request resumes.
    token_ids: list[int]
    sampling: SamplingParams
    # Block ids per KV-cache group, in group order (prefix-cache hits included).
    block_ids: list[list[int]]
    # Tokens whose K/V are already in the cache (a prefix-cache hit).
    num_computed_tokens: int
    # Tokens to compute in this step (a chunk of the prompt, or all of it).
    num_new_tokens: int
    # How many of token_ids are the prompt (None: all); penalties and min_tokens need it.
    num_prompt_tokens: int | None = None
    # A constrained request's compiled grammar (xgrammar's serialized form), with its first
    # step only: the sampling rank keeps its matcher across preemptions.
    grammar: bytes | None = None
    # Per group, the blocks the request holds beside its table for speculative decoding's
    # draft states (a Mamba group with prefix caching); empty when no group holds any.
    draft_block_ids: list[list[int]] = []


class RequestDelta(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    # Blocks appended to each group's table since the last step.
    new_block_ids: list[list[int]]
    num_computed_tokens: int
    # Tokens to compute: the request's last known token, then its drafts when it has any.
    num_new_tokens: int
    # Speculative tokens proposed after the last known token (n-gram drafts): computed with
    # it in this step and verified against the model's own samples; the worker keeps only
    # those accepted.
    draft_token_ids: list[int] = []


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    new_requests: list[NewRequest] = []
    deltas: list[RequestDelta] = []
    # Requests that ended for good (finished or aborted) since the last step; forget them.
    finished_ids: list[str] = []
    # Requests preempted since the last step: forget their tokens and blocks, but keep their
    # sampling state (a seeded generator continues when the request comes back as new).
    preempted_ids: list[str] = []

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.new_requests) + sum(
            d.num_new_tokens for d in self.deltas
        )


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    # Request id -> the token sampled this step, for requests that reached their last known
    # token (a request in the middle of a chunked prefill samples nothing); after drafts, the
    # token that follows the accepted ones.
    sampled: dict[str, int] = {}
    # For the sampled requests that asked: their token's log-probability and alternatives.
    logprobs: dict[str, TokenLogprobs] = {}
    # Seconds this rank spent in the model forward and its LM head (the rest of a step is
    # overhead).
    forward_seconds: float = 0.0
    # Seconds this rank spent on the step, from taking its plan to replying, and the seconds
    # it sat between its reply to the step before and taking this one (none when the plan
    # was waiting): what passes between two replies is their sum.
    step_seconds: float = 0.0
    waited_seconds: float = 0.0
    # Constrained requests whose grammar refused the token sampled for them: they fail.
    refused: list[str] = []
    # Requests that came with drafts -> how many of them were accepted. Their new tokens
    # are that many drafts, then the token in ``sampled``.
    num_accepted: dict[str, int] = {}
