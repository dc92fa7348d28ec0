"""How a step plan reaches the workers. The scheduler only ever calls ``execute``; swapping
actor calls for a compiled graph or shared memory changes this file and nothing else."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult


class WorkerLostError(RuntimeError):
    """A worker died or failed a step; the engine cannot go on."""


class StepTransport(Protocol):
    async def execute(self, plan: StepPlan) -> StepResult: ...


def step_thread() -> ThreadPoolExecutor:
    """The one thread an in-process worker is built and stepped on. One thread, because each
    thread that runs torch ops gets its own OpenMP team: a second team's idle threads make
    OpenMP see more threads than cores and wake every parallel region from sleep (SmolLM2's
    forward took 77 ms instead of 19 with the weights loaded on one thread and stepped on
    another)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvray-step")


class InProcessTransport:
    """One in-process worker (TP=1), stepped in one thread so the event loop keeps serving
    and steps sent back to back run in the order they were sent: ``thread``, the one the
    worker was built on (``step_thread``)."""

    def __init__(self, worker, thread: ThreadPoolExecutor | None = None):
        self.worker = worker
        self._thread = thread or step_thread()

    async def execute(self, plan: StepPlan) -> StepResult:
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.run_in_executor(self._thread, self.worker.execute, encode(plan))
        except Exception as exc:
            raise WorkerLostError(f"the worker failed a step: {exc}") from exc
        return decode(reply, StepResult)


class RayActorTransport:
    """Every TP rank is a Ray actor; all run the same plan, rank 0's result is the answer."""

    def __init__(self, actors: list):
        self.actors = actors

    async def execute(self, plan: StepPlan) -> StepResult:
        """Ray runs one caller's calls to an actor in the order they were made, so a step sent
        while the previous one runs waits behind it on every rank."""
        payload = encode(plan)
        try:
            replies = await asyncio.gather(*(a.execute.remote(payload) for a in self.actors))
        except Exception as exc:  # RayActorError, task errors
            raise WorkerLostError(f"a worker actor failed: {exc}") from exc
        return decode(replies[0], StepResult)
