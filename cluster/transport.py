"""How a step plan reaches the workers. The scheduler only ever calls ``execute``; swapping
actor calls for a compiled graph or shared memory changes this file and nothing else."""

from __future__ import annotations

import asyncio
from typing import Protocol

from kvcore import decode, encode
from workers.step_plan import StepPlan, StepResult


class WorkerLostError(RuntimeError):
    """A worker died or failed a step; the engine cannot go on."""


class StepTransport(Protocol):
    async def execute(self, plan: StepPlan) -> StepResult: ...


class InProcessTransport:
    """One in-process worker (TP=1), stepped in a thread so the event loop keeps serving."""

    def __init__(self, worker):
        self.worker = worker

    async def execute(self, plan: StepPlan) -> StepResult:
        try:
            reply = await asyncio.to_thread(self.worker.execute, encode(plan))
        except Exception as exc:
            raise WorkerLostError(f"the worker failed a step: {exc}") from exc
        return decode(reply, StepResult)


class RayActorTransport:
    """Every TP rank is a Ray actor; all run the same plan, rank 0's result is the answer."""

    def __init__(self, actors: list):
        self.actors = actors

    async def execute(self, plan: StepPlan) -> StepResult:
        payload = encode(plan)
        try:
            replies = await asyncio.gather(*(a.execute.remote(payload) for a in self.actors))
        except Exception as exc:  # RayActorError, task errors
            raise WorkerLostError(f"a worker actor failed: {exc}") from exc
        return decode(replies[0], StepResult)
