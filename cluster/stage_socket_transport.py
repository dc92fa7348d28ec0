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

import asyncio

from cluster.socket_transport import _RankChannel, open_channels
from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult
from workers.stage_wire import StageStep


class SocketStagedTransport:
    def __init__(self, stages: list[list]):
        self.stages = stages  # the worker actors of each stage, TP rank order
        self._channels: list[list[_RankChannel]] | None = None
        self._connecting: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owed: list[tuple[bytes, bytes]] = []

    async def _connect(self) -> list[list[_RankChannel]]:
        self._loop = asyncio.get_running_loop()
        return [await open_channels(actors, stage=True) for actors in self.stages]

    async def execute(self, plan: StepPlan) -> StepResult:
        if self._channels is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._connect())
            # No await between connecting and writing, so steps go out in the order sent.
            self._channels = await asyncio.shield(self._connecting)
        payload = encode(plan)
        owed, self._owed = self._owed, []
        earlier = encode(StageStep(plan=payload, owed=owed))
        last = encode(StageStep(plan=payload))
        replies = [
            channel.send(earlier if index < len(self._channels) - 1 else last)
            for index, channels in enumerate(self._channels)
            for channel in channels
        ]
        result = await replies[-len(self._channels[-1])]  # the last stage's TP rank 0
        for reply in replies:  # the others' acknowledgements: a failure is the step's
            await reply
        self._owed.append((payload, result))
        return decode(result, StepResult)

    def close(self) -> None:
        """Close every channel (the ranks then wait for a new one); from any thread."""
        stages, self._channels = self._channels or [], None
        if self._loop is None or self._loop.is_closed():
            return
        for channel in (channel for channels in stages for channel in channels):
            self._loop.call_soon_threadsafe(channel.close)
