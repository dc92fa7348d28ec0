"""Steps through pipeline stages over step channels (``--step-transport socket``, the default
with ``-pp``): a TCP connection from the controller to every rank of every stage
(``workers.step_channel``), and no Ray call per step.

A step's frame (``workers.stage_wire.StageStep``) goes to every rank of every stage when it is
sent. Each stage reads its frames in the order written, takes the hidden states of the stage
before from it directly (torch.distributed point to point: gloo on CPU, NCCL on GPU, never
through the controller) and sends its own to the next; the last stage's TP rank 0 answers
with the result, every other rank with an empty acknowledgement. So every stage runs the steps
in the order the engine sent them, and while the last stage runs one, the first can run the
next. The stages before the last learn the tokens of answered steps with the next frame sent
after them (``StagedTransport`` does the same over Ray calls).
"""

from __future__ import annotations

from cluster.socket_transport import LazyChannels
from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult
from workers.stage_wire import StageStep


class SocketStagedTransport:
    def __init__(self, stages: list[list]):
        self.stages = stages  # the worker actors of each stage, TP rank order
        # One channel per rank, stage after stage: the last stage's ranks come last.
        self._channels = LazyChannels([actor for actors in stages for actor in actors], stage=True)
        self._last_stage_from = sum(len(actors) for actors in stages[:-1])
        self._owed: list[tuple[bytes, bytes]] = []

    async def execute(self, plan: StepPlan) -> StepResult:
        channels = await self._channels.get()
        payload = encode(plan)
        owed, self._owed = self._owed, []
        earlier = encode(StageStep(plan=payload, owed=owed))
        last = encode(StageStep(plan=payload))
        replies = [
            channel.send(earlier if index < self._last_stage_from else last)
            for index, channel in enumerate(channels)
        ]
        result = await replies[self._last_stage_from]  # the last stage's TP rank 0
        for reply in replies:  # the others' acknowledgements: a failure is the step's
            await reply
        self._owed.append((payload, result))
        return decode(result, StepResult)

    def close(self) -> None:
        """Close every channel (the ranks then wait for a new one); from any thread."""
        self._channels.close()
