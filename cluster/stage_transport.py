"""Steps through pipeline stages on Ray (``--pipeline-parallel-size``), several in flight.

Every rank of a stage runs the plan; a stage's TP rank 0 returns its hidden states, which
every rank of the next stage takes as an argument (Ray resolves the object for it). The last
stage's rank 0 answers.

A step's calls to every stage are submitted when ``execute`` is called, before it returns its
awaitable: a worker actor runs one submitter's calls in the order they were submitted, so
every stage runs the steps in the order the engine sent them, and while the last stage runs
one step the first can run the next. The engine keeps the steps in flight free of each
other's samples (``Scheduler.max_steps_in_flight``): the stages before the last learn the
tokens of an answered step with the next call sent after it (its plan and result ride along:
a call less per step, ~1.5 ms here), before any step that reads them.
"""

from __future__ import annotations

from collections.abc import Awaitable

from cluster.errors import WorkerLostError
from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult


class StagedTransport:
    def __init__(self, stages: list[list]):
        self.stages = stages  # the worker actors of each stage, TP rank order
        # Answered steps' plans and results the stages before the last have not seen.
        self._owed: list[tuple[bytes, bytes]] = []

    def close(self) -> None:
        """Nothing to release: the actors are their owner's."""

    def execute(self, plan: StepPlan) -> Awaitable[StepResult]:
        """Submit ``plan`` to every stage now; the awaitable gives the last stage's answer."""
        payload = encode(plan)
        owed, self._owed = self._owed, []
        try:
            hidden, others = None, []
            for actors in self.stages[:-1]:
                refs = [actor.run_stage.remote(payload, hidden, owed) for actor in actors]
                hidden, others = refs[0], others + refs[1:]  # the other ranks return None
            last = [actor.execute_stage.remote(payload, hidden) for actor in self.stages[-1]]
        except Exception as exc:  # an actor handle that cannot take calls any more
            return _failed(exc)
        return self._answer(payload, last, others)

    async def _answer(self, payload: bytes, last: list, others: list) -> StepResult:
        try:
            replies = [await ref for ref in last]
            for ref in others:
                await ref
        except Exception as exc:  # RayActorError, task errors
            raise WorkerLostError(f"a pipeline stage's worker failed: {exc}") from exc
        self._owed.append((payload, replies[0]))
        return decode(replies[0], StepResult)


async def _failed(exc: Exception) -> StepResult:
    raise WorkerLostError(f"a pipeline stage's worker failed: {exc}") from exc
