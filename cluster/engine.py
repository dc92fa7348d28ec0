"""The async engine: validates requests, runs the step loop, streams outputs.

One asyncio task runs the loop: schedule, send the plan through the transport, apply the
result, hand each request's new tokens and text to its stream. Request handlers only enqueue
and read their own stream, so a slow client never stalls the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from cluster.scheduler.detokenizer import IncrementalDetokenizer
from cluster.scheduler.request import EngineRequest
from cluster.scheduler.scheduler import Scheduler
from cluster.scheduler.stop import releasable_text
from cluster.stats import EngineStats
from cluster.transport import StepTransport, WorkerLostError
from kvcore.kv_request import KVRequest
from workers.sampling import SamplingParams
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request is malformed; nothing was scheduled."""


class OverloadedError(RuntimeError):
    """The waiting queue is full."""


class EngineDeadError(RuntimeError):
    """A worker was lost; the engine serves nothing more."""


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


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
    ):
        self.scheduler = scheduler
        self.transport = transport
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.dead_reason: str | None = None
        self.num_steps = 0
        self._streams: dict[str, asyncio.Queue] = {}
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.on_death = None  # called once when a worker is lost
        self.stats = EngineStats()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    # -- requests ---------------------------------------------------------------------------

    def prepare(
        self, prompt: str | Sequence[int], sampling: SamplingParams, request_id: str | None = None
    ) -> EngineRequest:
        """Validate and build a request; raises before anything is scheduled."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequestError("The prompt is empty; give at least one token.")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"Prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}"
            )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"The prompt has {len(token_ids)} tokens, but this model allows at most "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len}, with room for "
                "one output token)."
            )
        if len(self.scheduler.waiting) >= self.max_queue_len:
            raise OverloadedError(
                f"The queue holds {len(self.scheduler.waiting)} waiting requests, its limit; "
                "retry later."
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already running.")
        kv = KVRequest(
            request_id, token_ids, hash_block_size=self.scheduler.coordinator.hash_block_size
        )
        return EngineRequest(
            request_id=request_id,
            kv=kv,
            sampling=sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            arrival_index=next(self._arrivals),
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` and yield its outputs until it finishes; leaving early aborts it."""
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
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started = time.perf_counter()
            step = self.scheduler.schedule()
            if step.is_empty:
                await asyncio.sleep(0.001)  # blocked on memory: let aborts and frees arrive
                continue
            try:
                result = await self.transport.execute(step.plan)
            except WorkerLostError as exc:
                self._die(str(exc))
                return
            self.num_steps += 1
            for request in self.scheduler.update(step, result):
                self._deliver(request)
            self.stats.record_step(time.perf_counter() - started, result.forward_seconds)
            if self.stats.wants_waste_sample():
                self.stats.record_waste(*self.scheduler.kv_slot_usage())

    def _deliver(self, request: EngineRequest) -> None:
        stream = self._streams.get(request.request_id)
        finished = request.is_finished
        if finished and request.finish_reason != "stop":
            request.detokenizer.flush()  # a stop already cut the text where it must end
        text = releasable_text(request)
        tokens, request.pending_token_ids = request.pending_token_ids, []
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
            )
        )

    def _die(self, reason: str) -> None:
        self.dead_reason = f"The engine lost a worker and stopped serving: {reason}"
        logger.error(self.dead_reason)
        error = EngineDeadError(self.dead_reason)
        for stream in list(self._streams.values()):
            stream.put_nowait(error)
        if self.on_death is not None:
            self.on_death()
