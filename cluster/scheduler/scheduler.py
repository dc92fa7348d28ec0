"""Continuous batching under a token budget, with chunked prefill, prefix-cache hits and
preemption by recompute.

Each step the scheduler first gives running requests their next tokens (one for a decode, the
rest of the prompt, chunked, for a prefill), oldest first; when the pool runs out of blocks it
preempts the newest running request (its blocks go back; it will recompute, helped by the
prefix cache). With a proposer (speculative decoding) a decode also carries drafts, and its
computed count falls back to what the workers accepted when the step returns, so the prefix
cache only ever holds verified tokens. With budget and sequence slots left, waiting requests
are admitted in arrival order with their longest cached prefix. The scheduler sees block ids
and counts only; the coordinator owns the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cluster.scheduler.request import EngineRequest, RequestStatus
from cluster.speculative.ngram import NgramProposer
from kvcore.coordinator import KVCacheCoordinator
from workers.protocol import NewRequest, RequestDelta, StepPlan, StepResult


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    # Through pipeline stages: steps in flight at once, each of requests the others do not
    # sample for (1: one step at a time). None: one stage, where a step planned while one
    # runs carries the same requests on.
    micro_batches: int | None = None


@dataclass
class ScheduledStep:
    plan: StepPlan
    # (request, tokens computed for it this step), in plan order.
    scheduled: list[tuple[EngineRequest, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.plan.finished_ids or self.plan.preempted_ids)


def new_request_message(
    request: EngineRequest,
    block_ids: list[list[int]],
    num_new_tokens: int,
    draft_block_ids: list[list[int]] | None = None,
) -> NewRequest:
    """What the workers first learn of ``request``: everything user-supplied that reaches
    them (id, token ids, sampling) travels here."""
    kv = request.kv
    return NewRequest(
        request_id=request.request_id,
        token_ids=list(kv.token_ids),
        num_prompt_tokens=kv.num_prompt_tokens,
        sampling=request.sampling,
        block_ids=block_ids,
        num_computed_tokens=kv.num_computed_tokens,
        num_new_tokens=num_new_tokens,
        # A resumed request's matcher is still on the sampling rank.
        grammar=None if request.was_sent else request.grammar,
        draft_block_ids=draft_block_ids or [],
    )


@dataclass
class SpeculationStats:
    """Drafts sent and accepted since the engine started (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # steps in which a request carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts k+1 deep

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        missing = num_drafts - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class Scheduler:
    def __init__(
        self,
        coordinator: KVCacheCoordinator,
        config: SchedulerConfig,
        proposer: NgramProposer | None = None,
    ):
        self.coordinator = coordinator
        self.config = config
        # Drafts for decodes (None: no speculative decoding).
        self.proposer = proposer
        self.speculation = SpeculationStats()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.on_finish = None  # called with each request that finishes, for whatever reason
        self._finished_ids: list[str] = []  # tell the workers to forget these
        self._preempted_ids: list[str] = []  # ... and these, but keep their sampling state
        self.num_preemptions = 0
        self.num_finished = 0  # requests that ended, for whatever reason
        # Prefix-cache lookups of admitted prompts: tokens queried, found, found per group.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_group_hit_tokens = [0] * len(coordinator.managers)

    # -- requests in and out ---------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> EngineRequest | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, "abort")
        return request

    def finish(self, request: EngineRequest, reason: str) -> None:
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.num_finished += 1
        self.coordinator.free(request.kv)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.was_sent:
            self._finished_ids.append(request.request_id)
            request.is_on_workers = request.was_sent = False
        del self.requests[request.request_id]
        if self.on_finish is not None:
            self.on_finish(request)

    @property
    def schedules_ahead(self) -> bool:
        """Whether a step may be planned while the one before runs. Not with drafts: a
        request's tokens after a verifying step are unknown until it returns."""
        return self.proposer is None

    @property
    def max_steps_in_flight(self) -> int:
        """Steps the engine may send before the oldest answers: one per micro-batch through
        pipeline stages; else two, the second planned while the first runs; one with drafts."""
        if not self.schedules_ahead:
            return 1
        return 2 if self.config.micro_batches is None else self.config.micro_batches

    @property
    def _pipelined(self) -> bool:
        """Whether the steps in flight are micro-batches of pipeline stages."""
        return self.config.micro_batches is not None and self.max_steps_in_flight > 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids)

    # -- one step --------------------------------------------------------------------------

    def schedule(self, *, ahead: bool = False) -> ScheduledStep:
        """The next step. ``ahead``: a step already sent is still running (asynchronous
        scheduling). Its samples count as known tokens (the workers hold them by then);
        requests that step ends by length are left out; and nothing is preempted, since a
        preempted request would lose the token that step samples for it: when a request
        cannot grow, the step stops there and preemption waits for the results."""
        budget = self.config.max_num_batched_tokens
        # (request, tokens to compute, blocks added, drafts among those tokens)
        scheduled: list[tuple[EngineRequest, int, list[list[int]], list[int]]] = []
        size = self._micro_batch_size()
        budget, preempted = self._schedule_running(budget, scheduled, ahead, size)
        if not preempted:
            self._schedule_waiting(budget, scheduled, size)
        return self._build_plan(scheduled)

    def _micro_batch_size(self) -> int:
        """The most requests one step takes: through pipeline stages, its share of those that
        can run, so each step in flight has some; else every one that fits."""
        if not self._pipelined:
            return self.config.max_num_seqs
        active = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-active // self.config.micro_batches))

    def _left_for_later(self, request: EngineRequest) -> bool:
        """Whether a step planned while others run leaves ``request`` out. At one stage, when
        a step in flight ends it by length. Through pipeline stages, while a step in flight
        samples for it: the first stage cannot know that token before the last has sampled
        it (a prompt's chunks may follow each other: every stage runs steps in order)."""
        if self._pipelined:
            return request.num_inflight_samples > 0
        return request.is_at_limit(self.config.max_model_len)

    def _schedule_running(self, budget: int, scheduled, ahead: bool, size: int) -> tuple[int, bool]:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0 and len(scheduled) < size:
            request = self.running[index]
            num_new = min(request.num_pending_tokens, budget)
            if num_new <= 0 or (ahead and self._left_for_later(request)):
                index += 1
                continue
            drafts = self._drafts(request, budget) if num_new == 1 else []
            num_new += len(drafts)
            new_blocks = self.coordinator.allocate(request.kv, num_new)
            if new_blocks is None and drafts:  # no room to speculate: decode plainly
                drafts, num_new = [], 1
                new_blocks = self.coordinator.allocate(request.kv, num_new)
            if new_blocks is None and ahead:
                return budget, True  # out of blocks: preempt once the results are in
            while new_blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = self.coordinator.allocate(request.kv, num_new)
            if new_blocks is None:
                break
            scheduled.append((request, num_new, new_blocks, drafts))
            budget -= num_new
            index += 1
        return budget, preempted

    def _drafts(self, request: EngineRequest, budget: int) -> list[int]:
        """Drafts for a decode whose tokens are all known: as many as the proposer finds,
        within the step's budget and so that accepting all of them (and the token after)
        passes neither ``max_tokens`` nor the model's length."""
        if self.proposer is None or request.num_inflight_samples:
            return []
        if not request.sampling.can_verify_drafts:
            return []
        kv = request.kv
        room = min(
            budget - 1,
            request.sampling.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - kv.num_tokens - 1,
        )
        return self.proposer.propose(kv.token_ids, room)

    def _schedule_waiting(self, budget: int, scheduled, size: int) -> None:
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < size
        ):
            request = self.waiting[0]
            hit = self.coordinator.find_longest_cache_hit(request.kv)
            num_new = min(request.kv.num_tokens - hit.num_tokens, budget)
            new_blocks = self.coordinator.allocate(request.kv, num_new, hit)
            if new_blocks is None:
                break  # no room; it stays first in line
            self.waiting.popleft()
            request.kv.num_computed_tokens = hit.num_tokens
            if request.status is RequestStatus.WAITING:
                request.num_cached_prompt_tokens = min(hit.num_tokens, request.num_prompt_tokens)
                self._record_lookup(request, hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, new_blocks, []))
            budget -= num_new

    def _record_lookup(self, request: EngineRequest, hit) -> None:
        self.prefix_queried_tokens += request.num_prompt_tokens
        self.prefix_hit_tokens += request.num_cached_prompt_tokens
        for group_id, num_tokens in enumerate(hit.group_num_tokens):
            self.prefix_group_hit_tokens[group_id] += min(num_tokens, request.num_prompt_tokens)

    def _preempt(self, request: EngineRequest) -> None:
        """Give back every block; the request recomputes from its tokens when resumed."""
        self.running.remove(request)
        self.coordinator.free(request.kv)
        request.kv.num_computed_tokens = 0
        request.num_inflight_samples = 0  # preemption waits for every step's results
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        if request.is_on_workers:
            self._preempted_ids.append(request.request_id)
            request.is_on_workers = False
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _build_plan(self, scheduled) -> ScheduledStep:
        """The step's plan; each request's computed count moves past this step's tokens
        now (so the next step can be planned before this one returns), and a request whose
        step reaches its last known token will sample one more."""
        new_requests, deltas = [], []
        for request, num_new, new_blocks, drafts in scheduled:
            kv = request.kv
            if request.is_on_workers:
                deltas.append(
                    RequestDelta(
                        request_id=request.request_id,
                        new_block_ids=new_blocks,
                        num_computed_tokens=kv.num_computed_tokens,
                        num_new_tokens=num_new,
                        draft_token_ids=drafts,
                    )
                )
            else:
                block_ids = self.coordinator.get_block_ids(kv)
                draft_ids = self.coordinator.get_draft_block_ids(kv)
                new_requests.append(new_request_message(request, block_ids, num_new, draft_ids))
                request.is_on_workers = request.was_sent = True
            kv.num_computed_tokens += num_new
            request.draft_token_ids = drafts
            if kv.num_computed_tokens - len(drafts) == request.num_known_tokens:
                request.num_inflight_samples += 1
        plan = StepPlan(
            new_requests=new_requests,
            deltas=deltas,
            finished_ids=self._finished_ids,
            preempted_ids=self._preempted_ids,
        )
        self._finished_ids, self._preempted_ids = [], []
        return ScheduledStep(plan, [(request, num_new) for request, num_new, _, _ in scheduled])

    def update(
        self, step: ScheduledStep, result: StepResult
    ) -> tuple[list[EngineRequest], list[tuple[EngineRequest, Exception]]]:
        """Apply a step's result. Returns the requests with a new token, and those whose
        output could not be applied (with why); one request's failure is its own. Whether a
        new token ends its request is the output stage's to say (``cluster.output.stop``)."""
        touched, failed = [], []
        for request, _ in step.scheduled:
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            try:
                if self._apply(request, result):
                    touched.append(request)
                    logprobs = result.logprobs.get(request.request_id)
                    if logprobs is not None:
                        request.pending_logprobs.append(logprobs)
            except Exception as exc:
                failed.append((request, exc))
        return touched, failed

    def _apply(self, request: EngineRequest, result: StepResult) -> bool:
        """Take in ``request``'s part of a step's result; True when it has new tokens.
        Drafts rejected fall out of the computed count (their slots are rewritten by later
        steps). Full blocks are offered to the prefix cache up to what the steps sent will
        have computed: any step that could reuse them runs after those."""
        kv = request.kv
        token = result.sampled.get(request.request_id)
        drafts, request.draft_token_ids = request.draft_token_ids, []
        new_tokens = []
        if drafts:
            if token is None:
                raise RuntimeError("the workers sampled nothing after its drafts")
            num_accepted = result.num_accepted.get(request.request_id, 0)
            if not 0 <= num_accepted <= len(drafts):
                raise RuntimeError(f"{num_accepted} of {len(drafts)} drafts accepted")
            kv.num_computed_tokens -= len(drafts) - num_accepted
            new_tokens = drafts[:num_accepted]
            self.speculation.record(len(drafts), num_accepted)
        if token is not None:
            request.num_inflight_samples -= 1
            new_tokens.append(token)
            kv.append_token_ids(new_tokens)
        self.coordinator.cache_blocks(kv, min(kv.num_computed_tokens, kv.num_tokens))
        request.num_step_tokens = len(new_tokens)
        if token is None:
            return False
        request.pending_token_ids.extend(new_tokens)
        return True

    def kv_slot_usage(self) -> tuple[int, int]:
        """(token slots in blocks the running requests hold, slots holding a computed token),
        over every KV-cache group. Null entries (blocks a window gave back) are not held."""
        block_sizes = [g.kv_cache_spec.block_size for g in self.coordinator.config.kv_cache_groups]
        allocated = used = 0
        for request in self.running:
            computed = request.kv.num_computed_tokens
            for size, ids in zip(
                block_sizes, self.coordinator.get_block_ids(request.kv), strict=True
            ):
                for index, block_id in enumerate(ids):
                    if block_id:
                        allocated += size
                        used += min(size, max(0, computed - index * size))
        return allocated, used
