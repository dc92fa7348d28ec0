"""One request as the controller sees it: prompt, sampling, KV bookkeeping, outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cluster.output.detokenizer import IncrementalDetokenizer
from kvcore.kv_request import KVRequest
from workers.protocol import TokenLogprobs
from workers.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    request_id: str
    kv: KVRequest  # token ids, computed count, prefix hashes
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_index: int
    status: RequestStatus = RequestStatus.WAITING
    num_cached_prompt_tokens: int = 0
    # Whether the workers hold this request's state (false before its first step and after a
    # preemption, when it must be sent again as a new request).
    is_on_workers: bool = False
    # Whether the workers have ever seen it: its sampling state (a seeded generator) lives
    # there from its first step until it finishes, across preemptions.
    was_sent: bool = False
    finish_reason: str | None = None
    # Tokens that steps already sent will sample, not yet back here (0 or 1): the workers
    # know them by the time a later step runs, so the scheduler counts them as known.
    num_inflight_samples: int = 0
    # Output pending delivery to the client since the last step.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when asked for
    arrival_time: float = field(default_factory=time.monotonic)  # for latency metrics
    last_token_time: float | None = None  # when its latest token arrived (None: none yet)
    emitted_text_len: int = 0  # characters already sent, for stop-string hold-back
    # A constrained request's compiled grammar, sent to the workers with its first step.
    grammar: bytes | None = None
    # Speculative tokens sent with the step in flight, to verify there (empty: none).
    draft_token_ids: list[int] = field(default_factory=list)
    # Tokens the latest step added: one, or more when drafts were accepted.
    num_step_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.kv.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.kv.token_ids[: self.kv.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.kv.token_ids[self.kv.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.kv.num_tokens - self.kv.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_known_tokens(self) -> int:
        """Tokens the workers will hold once the steps already sent have run."""
        return self.kv.num_tokens + self.num_inflight_samples

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute after the steps already sent."""
        return self.num_known_tokens - self.kv.num_computed_tokens

    def is_at_limit(self, max_model_len: int) -> bool:
        """Whether the tokens already coming end it by length (max_tokens or the model's)."""
        num_outputs = self.num_known_tokens - self.kv.num_prompt_tokens
        return num_outputs >= self.sampling.max_tokens or self.num_known_tokens >= max_model_len
