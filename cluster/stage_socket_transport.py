"""Steps through pipeline stages over step channels (``--step-transport socket``, the default
with ``-pp``): a TCP connection from the controller to every rank of every stage
(``workers.step_channel``), and no Ray call per step.

A step's frame (``workers.stage_wire.StageStep``) goes to every rank of the first stage when
it is sent; the hidden states its TP rank 0 answers with go, in the next stage's frame, to
every rank of that stage, and so on; the last stage's rank 0 answers with the result. The
hidden states pass through the controller: one hop more than a worker-to-worker link would
take, but a step of two stages costs 3.2 ms of overhead here against 7.3 through Ray calls
(``cluster.transport.staged_transport``).

Every stage must run the steps in the order they were sent (a prompt's chunks may be in two
steps at once): the first stage's frames are written in that order when the steps are sent,
and each later stage's frame waits until the step before has written its own there. The
stages before the last learn the tokens of answered steps with the next frame sent after them
(``StagedTransport`` does the same over Ray calls).
"""

from __future__ import annotations

import asyncio

from cluster.socket_transport import _RankChannel, open_channels
from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult
from workers.stage_wire import HiddenStates, StageStep


class SocketStagedTransport:
    def __init__(self, stages: list[list]):
        self.stages = stages  # the worker actors of each stage, TP rank order
        self._channels: list[list[_RankChannel]] | None = None
        self._connecting: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owed: list[tuple[bytes, bytes]] = []
        # Per stage after the first: set once the latest step sent has written its frame there.
        self._written: list[asyncio.Future | None] = [None] * len(stages)

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
        turns = self._take_turns()
        try:
            result = await self._through_the_stages(payload, owed, turns)
        finally:  # a step that failed on the way lets the next go on (to fail too)
            for _, mine in turns[1:]:
                if not mine.done():
                    mine.set_result(None)
        self._owed.append((payload, result))
        return decode(result, StepResult)

    async def _through_the_stages(self, payload: bytes, owed: list, turns: list) -> bytes:
        replies = _send(self._channels[0], StageStep(plan=payload, owed=owed))
        others = replies[1:]
        for index, channels in enumerate(self._channels[1:], start=1):
            hidden = decode(await replies[0], HiddenStates)
            is_last = index == len(self.stages) - 1
            step = StageStep(plan=payload, owed=[] if is_last else owed, hidden=hidden)
            before, mine = turns[index]
            if before is not None:
                await before
            replies = _send(channels, step)
            mine.set_result(None)
            others += replies[1:]
        result = await replies[0]
        for reply in others:  # the other ranks' acknowledgements: a failure is the step's
            await reply
        return result

    def _take_turns(self) -> list[tuple[asyncio.Future | None, asyncio.Future | None]]:
        """For each stage after the first: (the step before's write there, this step's)."""
        turns: list = [(None, None)]
        for index in range(1, len(self.stages)):
            mine = asyncio.get_running_loop().create_future()
            turns.append((self._written[index], mine))
            self._written[index] = mine
        return turns

    def close(self) -> None:
        """Close every channel (the ranks then wait for a new one); from any thread."""
        stages, self._channels = self._channels or [], None
        if self._loop is None or self._loop.is_closed():
            return
        for channel in (channel for channels in stages for channel in channels):
            self._loop.call_soon_threadsafe(channel.close)


def _send(channels: list[_RankChannel], step: StageStep) -> list[asyncio.Future]:
    frame = encode(step)
    return [channel.send(frame) for channel in channels]
