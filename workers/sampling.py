"""Sampling parameters: the one definition of every sampling field, its default and its
limits, checked once where a request enters (front ends only name fields; the engine fills in
the model's defaults, then builds these). The sampler that applies them is ``workers.sampler``.
"""

from __future__ import annotations

import math

import msgspec

from workers.request_limits import ModelLimits, RequestFieldError, check_sampling_fields
from workers.structured_outputs import StructuredOutputs

DEFAULT_MAX_TOKENS = 16  # when a request does not say (clipped to what fits the model)
# Positive temperatures below this are raised to it, as vLLM does: logits divided by less can
# overflow fp32 (a subnormal temperature turns every logit into inf, and softmax into NaN).
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024  # all stop strings together
MAX_STOP_TOKEN_IDS = 256
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's do


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, clipped to the model's room
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps the whole vocabulary
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens are held back until this many are out
    presence_penalty: float = 0.0  # minus this once for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often a token was generated
    repetition_penalty: float = 1.0  # prompt and output tokens: logit / p if > 0, else * p
    # Log-probabilities of each generated token and this many alternatives (None: none).
    logprobs: int | None = None
    # What the output must match (a JSON schema, a regex...); None: free text.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Integer and text fields by the shared table, with the wire's limits; admission has
        # already applied the model's (cluster.admission).
        check_sampling_fields(msgspec.structs.asdict(self), ModelLimits())
        if self.structured_outputs is not None:
            self.structured_outputs.check()
        problem = _first_problem(self)
        if problem is not None:
            field, message = problem
            raise RequestFieldError(message, field)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_constrained(self) -> bool:
        return self.structured_outputs is not None

    @property
    def can_verify_drafts(self) -> bool:
        """Whether speculative drafts may be verified for a request with these parameters:
        one sample per position is all its output needs (no grammar to advance, no
        log-probabilities to report per draft)."""
        return not self.is_constrained and self.logprobs is None

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


# Every field a front end may set: what gRPC, HTTP, the clients and batch files name.
SAMPLING_FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__


def _first_problem(p: SamplingParams) -> tuple[str, str] | None:
    """(field, what is wrong with it, said with what is allowed) for ``p``'s first problem
    beyond its integer and text ranges; None when there is none."""
    if not math.isfinite(p.temperature) or p.temperature < 0:
        return "temperature", (
            f"temperature must be 0 (greedy) or a finite positive number, got {p.temperature} "
            f"(values below {MIN_TEMPERATURE} are raised to {MIN_TEMPERATURE})"
        )
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        return "top_p", f"top_p must be in (0, 1], got {p.top_p}"
    if len(p.stop) > MAX_STOP_STRINGS:
        return "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(p.stop)}"
    if any(not s for s in p.stop):
        return "stop", "stop strings must not be empty"
    if sum(len(s) for s in p.stop) > MAX_STOP_CHARS:
        return "stop", f"stop strings may hold at most {MAX_STOP_CHARS} characters together"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            return name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        return "repetition_penalty", (
            f"repetition_penalty must be a finite positive number, got {p.repetition_penalty}"
        )
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        return "min_tokens", (
            f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})"
        )
    return None
