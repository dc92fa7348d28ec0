"""Steps through pipeline stages on Ray (``--pipeline-parallel-size``), one step at a time.

Every rank of a stage runs the plan; a stage's TP rank 0 returns its hidden states, which
every rank of the next stage takes as an argument (Ray resolves the object for it). The last
stage's rank 0 answers. The stages before it learn the tokens it sampled with the next step's
call (the step's plan and result ride along: a call less per step, ~1.5 ms here). A step sent
while one runs (the engine schedules ahead) waits for it: the first stage must know a step's
tokens before it computes the next.
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
        # The last step's plan and result, which the stages before the last have not seen.
        self._owed: tuple[bytes, bytes] | None = None

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
            refs = [actor.run_stage.remote(payload, hidden, self._owed) for actor in actors]
            hidden, others = refs[0], others + refs[1:]  # the other ranks return None
        replies = await asyncio.gather(
            *(actor.execute_stage.remote(payload, hidden) for actor in self.stages[-1])
        )
        await asyncio.gather(*others)
        self._owed = (payload, replies[0])
        return decode(replies[0], StepResult)
