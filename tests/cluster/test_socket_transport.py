"""The controller's end of a step channel against a real worker end (a torch thread behind a
listener on loopback): replies meet their steps in order, a failed step and a closed channel
become ``WorkerLostError``, and a step cancelled while it runs leaves the channel working.
The whole transport, on Ray actors, is tested in ``test_ray_serving``."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.errors import WorkerLostError
from cluster.socket_transport import _RankChannel
from workers.step_channel import ChannelListener
from workers.torch_thread import TorchThread


def reverse(payload: bytes) -> bytes:
    if payload == b"fail":
        raise ValueError("the plan names no such request")
    if payload == b"slow":
        threading.Event().wait(0.2)
    return payload[::-1]


async def open_channel(rank: int = 0) -> _RankChannel:
    listener = ChannelListener("127.0.0.1")
    torch_thread = TorchThread()
    listener.accept_in_background(lambda conn: torch_thread.serve_channel(conn, reverse))
    reader, writer = await asyncio.open_connection(*listener.address)
    writer.write(listener.token)
    return _RankChannel(rank, reader, writer)


def test_replies_meet_their_steps_in_order():
    async def run():
        channel = await open_channel()
        replies = [channel.send(f"step {i}".encode()) for i in range(8)]
        assert await asyncio.gather(*replies) == [f"step {i}".encode()[::-1] for i in range(8)]
        channel.close()

    asyncio.run(run())


def test_a_failed_step_names_its_rank_and_the_next_step_goes_on():
    async def run():
        channel = await open_channel(rank=3)
        failed, after = channel.send(b"fail"), channel.send(b"ok")
        with pytest.raises(WorkerLostError, match=r"rank 3 failed a step: .*no such request"):
            await failed
        assert await after == b"ko"
        channel.close()

    asyncio.run(run())


def test_a_step_cancelled_while_it_runs_leaves_the_channel_working():
    async def run():
        channel = await open_channel()
        cancelled, waiting = channel.send(b"slow"), channel.send(b"abc")
        cancelled.cancel()
        assert await asyncio.wait_for(waiting, 5) == b"cba"
        assert await asyncio.wait_for(channel.send(b"xy"), 5) == b"yx"
        channel.close()

    asyncio.run(run())


def test_a_closed_channel_fails_the_waiting_step_and_every_later_one():
    async def run():
        channel = await open_channel(rank=1)
        waiting = channel.send(b"slow")
        channel.writer.transport.abort()  # as when the rank's process dies
        with pytest.raises(WorkerLostError, match="step channel to rank 1 closed"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(WorkerLostError, match="rank 1"):
            await channel.send(b"later")

    asyncio.run(run())
