"""``--step-transport socket``: each step plan goes to every TP rank over a TCP connection of
its own (``workers.step_channel``), with no Ray call per step and nothing spinning.

Connected at the first step: each actor opens a listener on its node and hands back its
address and token through a Ray call, which also proves the connection reaches the actor Ray
placed. Frames are written in the order steps are sent, so a step sent while the one before
runs waits in the socket and starts the moment that one replies; each rank's replies come
back in the same order, read by one task per rank. A rank that dies closes its connection,
which fails every step waiting on it (``WorkerLostError``) and every later one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from cluster.errors import WorkerLostError
from kvcore import decode, encode
from workers.protocol import StepPlan, StepResult
from workers.step_channel import HEADER, OK, frame, no_delay

logger = logging.getLogger(__name__)


class _RankChannel:
    """The connection to one rank and the replies it still owes, oldest first."""

    def __init__(self, rank: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.rank = rank
        self.writer = writer
        self.waiting: deque[asyncio.Future] = deque()
        self.lost: WorkerLostError | None = None
        self.reading = asyncio.ensure_future(self._read(reader))

    def send(self, payload: bytes) -> asyncio.Future:
        reply = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            reply.set_exception(self.lost)
            return reply
        self.waiting.append(reply)
        self.writer.write(frame(OK, payload))
        return reply

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                length, status = HEADER.unpack(await reader.readexactly(HEADER.size))
                payload = await reader.readexactly(length)
                reply = self.waiting.popleft()
                if reply.done():  # its step was cancelled: the engine is tearing down
                    continue
                if status == OK:
                    reply.set_result(payload)
                else:
                    text = payload.decode(errors="replace")
                    reply.set_exception(WorkerLostError(f"rank {self.rank} failed a step: {text}"))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._lose(WorkerLostError(f"the step channel to rank {self.rank} closed ({exc!r})"))
        except IndexError:  # a reply nobody waits for: the rank is out of step
            self._lose(WorkerLostError(f"rank {self.rank} replied to a step never sent"))

    def _lose(self, error: WorkerLostError) -> None:
        self.lost = error
        while self.waiting:
            reply = self.waiting.popleft()
            if not reply.done():
                reply.set_exception(error)
        self.writer.close()

    def close(self) -> None:
        self.reading.cancel()
        self._lose(WorkerLostError(f"the step channel to rank {self.rank} was closed"))


async def open_channels(actors: list, *, stage: bool = False) -> list[_RankChannel]:
    """A step channel to each of ``actors`` (pipeline stages' frames, with ``stage``)."""
    try:
        addresses = await asyncio.gather(*(a.open_step_channel.remote(stage) for a in actors))
    except Exception as exc:  # RayActorError
        raise WorkerLostError(f"a worker actor failed: {exc}") from exc
    channels = []
    for rank, (host, port, token) in enumerate(addresses):
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise WorkerLostError(f"cannot reach rank {rank} at {host}:{port}: {exc}") from exc
        no_delay(writer.get_extra_info("socket"))
        writer.write(token)
        channels.append(_RankChannel(rank, reader, writer))
    logger.info("Step channels open to %d rank(s)", len(channels))
    return channels


class LazyChannels:
    """Step channels to ``actors``, opened at the first step and kept for every step after
    (``stage``: pipeline stages' frames); closed from any thread."""

    def __init__(self, actors: list, *, stage: bool = False):
        self.actors, self.stage = actors, stage
        self._channels: list[_RankChannel] | None = None
        self._connecting: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def get(self) -> list[_RankChannel]:
        if self._channels is None:
            if self._connecting is None:
                self._loop = asyncio.get_running_loop()
                self._connecting = asyncio.ensure_future(
                    open_channels(self.actors, stage=self.stage)
                )
            # No await between connecting and writing, so steps go out in the order sent.
            self._channels = await asyncio.shield(self._connecting)
        return self._channels

    def close(self) -> None:
        """Close every channel (the ranks then wait for a new one)."""
        channels, self._channels = self._channels or [], None
        if self._loop is None or self._loop.is_closed():
            return
        for channel in channels:
            self._loop.call_soon_threadsafe(channel.close)


class SocketTransport:
    """Every TP rank is a Ray actor with a step channel; all run the same plan, rank 0's
    result is the answer."""

    def __init__(self, actors: list):
        self.actors = actors
        self._channels = LazyChannels(actors)

    async def execute(self, plan: StepPlan) -> StepResult:
        channels = await self._channels.get()
        payload = encode(plan)
        replies = await asyncio.gather(*(channel.send(payload) for channel in channels))
        return decode(replies[0], StepResult)

    def close(self) -> None:
        """Close every channel (the ranks then wait for a new one); from any thread."""
        self._channels.close()
