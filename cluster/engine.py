"""The async engine: validates requests, runs the step loop, streams outputs.

One asyncio task runs the loop: schedule, send the plan through the transport (steps ahead
as ``Scheduler.max_steps_in_flight`` allows), apply the result (the scheduler takes in the new
tokens; the output stage, ``cluster.output``, detokenizes them and ends the requests they
stop), hand each request's new tokens and text to its stream. Request handlers only enqueue
and read their own stream, so a slow client never stalls the loop.

Nothing in the loop fails silently. A request whose output cannot be processed fails alone
(INTERNAL) and gives its blocks back. A lost worker, a failed step or a scheduling error fails
every request in flight, and the engine rebuilds its worker group (``rebuild``) with a fresh
cache while health says NOT_SERVING; when rebuilding keeps failing, it stops serving for good.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from cluster.admission import Admission
from cluster.errors import (
    EngineDeadError,
    EngineInternalError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
)
from cluster.metrics import EngineMetrics
from cluster.output.stop import end_stopped, releasable_text
from cluster.scheduler.request import EngineRequest
from cluster.scheduler.scheduler import ScheduledStep, Scheduler
from cluster.stats import EngineStats
from cluster.transport import StepTransport, WorkerLostError
from workers.protocol import StepResult, TokenLogprobs
from workers.sampling import SamplingParams
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# A new worker group and the scheduler that goes with its cache.
Rebuild = Callable[[], Awaitable[tuple[StepTransport, Scheduler]]]


class EngineState(enum.Enum):
    SERVING = "serving"
    RECOVERING = "recovering"  # rebuilding the worker group
    DRAINING = "draining"  # finishing what runs, taking nothing new
    DEAD = "dead"


@dataclass
class SentStep:
    step: ScheduledStep
    task: asyncio.Future  # the transport's answer
    sent_at: float = field(default_factory=time.perf_counter)
    ahead: bool = False  # sent while the step before it was still running


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when asked for


class AsyncEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        transport: StepTransport,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_queue_len: int,
        rebuild: Rebuild | None = None,
        max_rebuild_attempts: int = 3,
    ):
        self.scheduler = scheduler
        self.transport = transport
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.rebuild = rebuild
        self.max_rebuild_attempts = max_rebuild_attempts
        self.metrics: EngineMetrics | None = None
        self.rebuild_backoff_s = 2.0  # doubles after each failed attempt, up to 30 s
        self.state = EngineState.SERVING
        self.state_reason = ""
        self.num_steps = 0
        self.num_rebuilds = 0
        self.most_steps_in_flight = 0  # steps sent before the oldest answered, at most
        self._streams: dict[str, asyncio.Queue] = {}
        self.admission = Admission(tokenizer, vocab_size=vocab_size, max_model_len=max_model_len)
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._last_answer_at = 0.0
        self.on_serving_change: Callable[[bool], None] | None = None  # health follows this
        self.stats = EngineStats()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    @property
    def is_serving(self) -> bool:
        return self.state is EngineState.SERVING

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _set_state(self, state: EngineState, reason: str = "") -> None:
        was_serving = self.is_serving
        self.state, self.state_reason = state, reason
        if was_serving != self.is_serving and self.on_serving_change is not None:
            self.on_serving_change(self.is_serving)

    def set_metrics(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.set_scheduler(self.scheduler)

    def set_scheduler(self, scheduler: Scheduler) -> None:
        """Serve with ``scheduler`` (a new one after a rebuild), its finishes counted."""
        self.scheduler = scheduler
        if self.metrics is not None:
            scheduler.on_finish = self.metrics.observe_finish
            self.metrics.rebased(scheduler)

    def _check_taking_requests(self) -> None:
        if self.state is EngineState.DEAD:
            raise EngineDeadError(self.state_reason)
        if self.state is not EngineState.SERVING:
            raise EngineUnavailableError(self.state_reason)

    async def drain(self, timeout: float) -> int:
        """Take no new requests and let the running ones finish for up to ``timeout`` seconds;
        then abort the rest. Returns how many were aborted."""
        if self.state is EngineState.SERVING:
            self._set_state(EngineState.DRAINING, "The server is shutting down; retry elsewhere.")
        return await finish_or_abort(self._streams, self.abort, timeout)

    # -- requests ---------------------------------------------------------------------------

    def sampling_params(self, fields: dict) -> SamplingParams:
        """The sampling of a request that sets ``fields`` (see ``cluster.admission``)."""
        return self.admission.sampling_params(fields)

    async def prepare(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        """Validate and build a request; raises before anything is scheduled."""
        self._check_taking_requests()
        return await self.admission.request(
            prompt,
            sampling,
            request_id,
            cache_salt=cache_salt,
            hash_block_size=self.scheduler.coordinator.hash_block_size,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` and yield its outputs until it finishes; leaving early aborts it."""
        # Checked again here, with no await before the request joins the scheduler: a rebuild
        # that started since ``prepare`` must not receive it into the scheduler it replaces.
        self._check_taking_requests()
        if len(self.scheduler.waiting) >= self.max_queue_len:
            raise OverloadedError(
                f"The queue holds {len(self.scheduler.waiting)} waiting requests, its limit; "
                "retry later."
            )
        if request.request_id in self._streams:
            raise InvalidRequestError(f"Request id {request.request_id!r} is already running.")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = stream
        self.scheduler.add(request)
        self._wakeup.set()
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if self.scheduler.abort(request.request_id) is not None:  # the client went away
                self._wakeup.set()

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id)
        if request is None:
            return False
        self._deliver(request)
        self._wakeup.set()
        return True

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        # Steps sent and not yet answered, oldest first: two at one stage, so the workers find
        # the next step waiting when one ends (asynchronous scheduling); through pipeline
        # stages one per micro-batch, so every stage has a step to run.
        sent: deque[SentStep] = deque()
        while self.state is not EngineState.DEAD:
            try:
                if not sent:
                    if not self.scheduler.has_work:
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        continue
                    if not self._send(sent, ahead=False):
                        await asyncio.sleep(0.001)  # blocked on memory: let frees arrive
                        continue
                self._fill(sent)
                await self._finish_step(sent)
            except WorkerLostError as exc:
                logger.error("The engine lost its worker group: %s", exc)
                await self._recover(
                    EngineUnavailableError(f"The engine lost a worker: {exc}"), sent
                )
            except Exception as exc:  # a bug in scheduling or the transport: never silent
                logger.exception("The engine step failed")
                await self._recover(EngineInternalError(f"The engine step failed: {exc!r}"), sent)

    def _fill(self, sent: deque[SentStep]) -> None:
        """Send steps until as many are in flight as the scheduler allows (or none is left
        to send); a step sent while none runs is not ahead."""
        while len(sent) < self.scheduler.max_steps_in_flight and self.scheduler.has_work:
            if not self._send(sent, ahead=bool(sent)):
                break
        self.most_steps_in_flight = max(self.most_steps_in_flight, len(sent))

    def _send(self, sent: deque[SentStep], *, ahead: bool) -> bool:
        """Schedule a step and send it to the workers; False when there was nothing to send.
        ``ahead``: the step before it is still running (see ``Scheduler.schedule``)."""
        step = self.scheduler.schedule(ahead=ahead)
        if step.is_empty:
            return False
        task = asyncio.ensure_future(self.transport.execute(step.plan))
        sent.append(SentStep(step, task, ahead=ahead))
        return True

    async def _finish_step(self, sent: deque[SentStep]) -> None:
        """Take the oldest step's answer into the scheduler, send the steps it makes
        possible, then stream its tokens: the workers start the next step (with drafts,
        the only one) before the clients hear of this one, not after."""
        sent_step = sent.popleft()
        result = await sent_step.task
        now = time.perf_counter()
        self.num_steps += 1
        touched, failed = self.scheduler.update(sent_step.step, result)
        if result.refused:
            failed += refused_by_grammar(self.scheduler, result.refused)
            touched = [r for r in touched if r.request_id not in result.refused]
        touched, unprocessed = end_stopped(self.scheduler, touched)
        # Requests that failed end before the next step is planned, so it does not carry them.
        for request, exc in failed + unprocessed:
            self._fail_request(request, exc)
        self._fill(sent)
        for request in touched:
            try:
                if self.metrics is not None:
                    self.metrics.observe_tokens(request, len(request.pending_token_ids))
                self._deliver(request)
            except Exception as exc:
                self._fail_request(request, exc)
        self.stats.record_step(self._step_wall(sent_step, result, now), result.forward_seconds)
        self._last_answer_at = now
        if self.metrics is not None:
            self.metrics.observe_step(self.scheduler)
        if self.stats.wants_waste_sample():
            self.stats.record_waste(*self.scheduler.kv_slot_usage())

    def _step_wall(self, sent_step: SentStep, result: StepResult, now: float) -> float:
        """The time between rank 0's answers to the step before and this one, of which what
        the forward does not fill is overhead. For a step sent ahead, rank 0's own clock
        says it (this loop may read an answer late while it streams the last step's tokens,
        but the workers are by then running the step after). Otherwise, from the previous
        answer or this step's sending (when the workers were idle) to this answer here."""
        if sent_step.ahead and result.step_seconds > 0.0:
            return result.waited_seconds + result.step_seconds
        return now - max(sent_step.sent_at, self._last_answer_at)

    def _deliver(self, request: EngineRequest) -> None:
        stream = self._streams.get(request.request_id)
        finished = request.is_finished
        if finished and request.finish_reason != "stop":
            request.detokenizer.flush()  # a stop already cut the text where it must end
        text = releasable_text(request)
        tokens, request.pending_token_ids = request.pending_token_ids, []
        logprobs, request.pending_logprobs = request.pending_logprobs, []
        if stream is None or (not tokens and not text and not finished):
            return
        stream.put_nowait(
            RequestOutput(
                request_id=request.request_id,
                token_ids=tokens,
                text=text,
                finish_reason=request.finish_reason if finished else None,
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=request.num_output_tokens,
                cached_prompt_tokens=request.num_cached_prompt_tokens,
                logprobs=logprobs or None,
            )
        )

    def _fail_request(self, request: EngineRequest, exc: BaseException) -> None:
        """One request's output could not be processed: it ends (its blocks go back), its
        client hears why, the others go on."""
        logger.error(
            "Request %s failed while its output was processed",
            request.request_id,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        self.scheduler.finish(request, "error")
        stream = self._streams.get(request.request_id)
        if stream is not None:
            stream.put_nowait(EngineInternalError(f"Processing this request failed: {exc!r}"))

    # -- recovery ---------------------------------------------------------------------------

    async def _recover(self, error: Exception, sent: deque[SentStep]) -> None:
        """Fail everything in flight with ``error``, then rebuild the worker group."""
        for step in sent:  # answers of a group that is going away
            step.task.cancel()
        await asyncio.gather(*(step.task for step in sent), return_exceptions=True)
        sent.clear()
        self._set_state(EngineState.RECOVERING, f"{error} The engine is rebuilding; retry.")
        for stream in list(self._streams.values()):
            stream.put_nowait(error)
        if self.rebuild is None or self.max_rebuild_attempts == 0:
            self._set_state(EngineState.DEAD, f"{error} The engine stopped serving.")
            logger.error(self.state_reason)
            return
        for attempt in range(1, self.max_rebuild_attempts + 1):
            started = time.perf_counter()
            try:
                self.transport, scheduler = await self.rebuild()
                self.set_scheduler(scheduler)
            except Exception:
                logger.exception("Rebuilding the worker group failed (attempt %d)", attempt)
                await asyncio.sleep(min(self.rebuild_backoff_s * 2 ** (attempt - 1), 30.0))
                continue
            self.num_rebuilds += 1
            logger.warning(
                "Rebuilt the worker group in %.1f s (attempt %d); serving again",
                time.perf_counter() - started,
                attempt,
            )
            self._set_state(EngineState.SERVING)
            return
        self._set_state(
            EngineState.DEAD,
            f"{error} Rebuilding the worker group failed {self.max_rebuild_attempts} times; "
            "the engine stopped serving.",
        )
        logger.error(self.state_reason)


def refused_by_grammar(scheduler: Scheduler, request_ids: list[str]) -> list:
    """Constrained requests whose grammar refused the token sampled for them (it allowed no
    other: a bug, never the client's doing), each failed alone."""
    requests = [scheduler.requests.get(request_id) for request_id in request_ids]
    error = RuntimeError("its grammar refused the token sampled for it")
    return [(request, error) for request in requests if request is not None]


async def finish_or_abort(streams: dict, abort: Callable[[str], object], timeout: float) -> int:
    """Wait up to ``timeout`` seconds for the requests of ``streams`` (request id -> its
    stream, removed as each ends) to finish, then ``abort`` the rest; returns how many."""
    deadline = time.monotonic() + timeout
    while streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(streams)
    for request_id in left:
        abort(request_id)
    return len(left)
