"""Steps through pipeline stages on Ray (``--pipeline-parallel-size``), one step at a time.

Every rank of a stage runs the plan; a stage's TP rank 0 returns its hidden states, which
every rank of the next stage takes as an argument: Ray moves the object from actor to actor
(across nodes when the stages are), never through the controller. The last stage's rank 0
answers, and the stages before it learn the tokens it sampled before the next step starts.
A step sent while one runs (the engine schedules ahead) waits for it: the first stage must
know a step's tokens before it computes the next.
"""

from __future__ import annotations

import asyncio

from cluster.errors import WorkerLostError
from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult


class StagedTransport:
    def __init__(self, stages: list[list]):
        self.stages = stages  # the worker actors of each stage, TP rank order
        self._one_at_a_time = asyncio.Lock()

    def close(self) -> None:
        """Nothing to release: the actors are their owner's."""

    async def execute(self, plan: StepPlan) -> StepResult:
        payload = encode(plan)
        async with self._one_at_a_time:
            try:
                return await self._through_the_stages(payload)
            except WorkerLostError:
                raise
            except Exception as exc:  # RayActorError, task errors
                raise WorkerLostError(f"a pipeline stage's worker failed: {exc}") from exc

    async def _through_the_stages(self, payload: bytes) -> StepResult:
        hidden, others = None, []
        for actors in self.stages[:-1]:
            refs = [actor.run_stage.remote(payload, hidden) for actor in actors]
            hidden, others = refs[0], others + refs[1:]  # the other ranks return None
        replies = await asyncio.gather(
            *(actor.execute_stage.remote(payload, hidden) for actor in self.stages[-1])
        )
        await asyncio.gather(*others)
        await asyncio.gather(
            *(
                actor.take_sampled.remote(payload, replies[0])
                for actors in self.stages[:-1]
                for actor in actors
            )
        )
        return decode(replies[0], StepResult)
