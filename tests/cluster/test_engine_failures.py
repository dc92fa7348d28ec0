"""The step loop never dies silently. Faults are injected into a running in-process server
(the real engine, scheduler, worker and gRPC server): a request whose output cannot be
processed fails alone; a failed scheduling step fails what is in flight and the engine rebuilds
its worker and serves again; when rebuilding keeps failing, it says so and stops serving."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.client import Client, KVRayError, UnavailableError
from cluster.config import EngineConfig
from cluster.engine import EngineState
from cluster.local import LocalServer

BASE = dict(kv_cache_memory_bytes=8 << 20, port=0, max_model_len=256, max_rebuild_attempts=2)


@pytest.fixture
def server():
    with LocalServer(EngineConfig(**BASE)) as running:
        running.engine.rebuild_backoff_s = 0.01
        yield running


def engine_stats(server) -> tuple[int, int, EngineState]:
    async def read():
        coordinator = server.engine.scheduler.coordinator
        return (
            coordinator.num_free_blocks,
            coordinator.block_pool.num_blocks - 1,
            server.engine.state,
        )

    return server.run(read())


def stream_in_thread(address, prompt, results, started=None, **sampling):
    """Stream ``prompt`` in a thread into ``results[prompt]`` (a token count, or the error);
    ``started`` is set at the first token."""

    def run():
        try:
            with Client(address, timeout=60) as client:
                count = 0
                for delta in client.stream(prompt, **sampling):
                    count += len(delta.token_ids)
                    if started is not None:
                        started.set()
                results[prompt] = count
        except KVRayError as exc:
            results[prompt] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_request_whose_output_fails_ends_alone(server):
    results, started = {}, threading.Event()
    healthy = stream_in_thread(
        server.address, "healthy", results, started, max_tokens=200, ignore_eos=True
    )
    assert started.wait(timeout=60)

    async def break_one():
        # The next request to arrive gets a detokenizer that fails on its first token.
        original = server.engine.prepare

        async def prepare(*args, **kwargs):
            request = await original(*args, **kwargs)

            def fail(token_ids):
                raise UnicodeError("a broken detokenizer")

            request.detokenizer.add = fail
            return request

        server.engine.prepare = prepare

    server.run(break_one())
    with Client(server.address, timeout=60) as client:
        with pytest.raises(KVRayError, match="Processing this request failed") as info:
            client.generate("doomed", max_tokens=20)
        assert info.value.code.name == "INTERNAL"
    healthy.join(timeout=60)
    assert results["healthy"] == 200  # the other stream went on
    free, usable, state = engine_stats(server)
    assert free == usable and state is EngineState.SERVING


def test_a_failed_step_fails_what_is_in_flight_then_the_engine_serves_again(server):
    results, events = {}, [threading.Event() for _ in range(3)]
    threads = [
        stream_in_thread(
            server.address, f"in flight {i}", results, event, max_tokens=230, ignore_eos=True
        )
        for i, event in enumerate(events)
    ]
    assert all(event.wait(timeout=60) for event in events)

    async def break_next_schedule():
        scheduler = server.engine.scheduler

        def schedule(**_):
            raise RuntimeError("a scheduling bug")

        scheduler.schedule = schedule

    server.run(break_next_schedule())
    for thread in threads:
        thread.join(timeout=60)
    errors = list(results.values())
    assert len(errors) == 3 and all(isinstance(e, KVRayError) for e in errors)
    assert all(e.code.name == "INTERNAL" and "a scheduling bug" in str(e) for e in errors)
    with Client(server.address, timeout=60) as client:
        deadline = time.monotonic() + 60
        while client.health() != "SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert len(client.generate("after the rebuild", max_tokens=5).token_ids) == 5
    assert server.engine.num_rebuilds == 1


def test_when_rebuilding_keeps_failing_the_engine_says_so_and_stops(server):
    async def break_everything():
        async def rebuild():
            raise RuntimeError("no GPUs left")

        def schedule(**_):
            raise RuntimeError("a scheduling bug")

        server.engine.rebuild = rebuild
        server.engine.scheduler.schedule = schedule

    server.run(break_everything())
    with Client(server.address, timeout=60) as client:
        with pytest.raises(KVRayError, match="a scheduling bug"):
            client.generate("the last one", max_tokens=5)
        deadline = time.monotonic() + 30
        while server.engine.state is not EngineState.DEAD:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(UnavailableError, match="failed 2 times; the engine stopped serving"):
            client.generate("refused", max_tokens=5)
