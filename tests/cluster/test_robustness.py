"""Nothing a client sends stops the server, under load or under fuzzing, and every KV block
comes back: against one Ray-backed server (TP 1), as users run it.

- A property-based fuzz test sends ``Generate`` requests with random field values (NaN, inf,
  subnormal, huge, negative, empty, invalid UTF-8, unknown fields) and random cancels.
- 400 concurrent sampled streams through ``AsyncClient`` finish with all their tokens while
  the health check keeps answering within a second.
- A storm of 100 streams cancelled after their first token gives every block back.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
import ray
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.api.v1 import kvray_pb2 as pb
from cluster.client import AsyncClient, Client
from tests.cluster.ray_helpers import serve, stop

# Codes a request may end with; UNAVAILABLE, INTERNAL or UNKNOWN would mean the engine broke.
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED}
SETTINGS = dict(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=256, max_queue_len=2048)


@pytest.fixture(scope="module")
def server():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    handle, address = serve(kv_cache_memory_bytes=32 << 20, **SETTINGS)
    yield handle, address
    stop(handle)
    ray.shutdown()


def wait_for_every_block(handle, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = ray.get(handle.stats.remote())
        if stats["num_free_blocks"] == stats["num_usable_blocks"] or time.monotonic() > deadline:
            return stats


def assert_still_serving(handle, address) -> None:
    stats = wait_for_every_block(handle)
    assert stats["num_free_blocks"] == stats["num_usable_blocks"], stats
    assert stats["state"] == "serving" and stats["num_rebuilds"] == 0
    with Client(address, timeout=60) as client:
        assert client.health() == "SERVING"
        assert len(client.generate("still here?", max_tokens=4, temperature=0).token_ids) == 4


# -- fuzzing ---------------------------------------------------------------------------------


def mostly(plausible, weird):
    """Plausible values three times in four, so many requests get to generate."""
    return st.one_of(plausible, plausible, plausible, weird)


weird_floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 5e-324, -0.0, 0.0, 1e308, -1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
SAMPLING_VALUES = {
    "max_tokens": mostly(st.integers(1, 24), st.one_of(st.integers(-3, 0), int64s)),
    "temperature": mostly(st.floats(0.0, 2.0), weird_floats),
    "top_p": mostly(st.floats(0.05, 1.0), weird_floats),
    "top_k": mostly(st.integers(-1, 300), int64s),
    "seed": int64s,
}


@st.composite
def generate_requests(draw) -> bytes:
    """A serialized GenerateRequest, possibly corrupted or with fields no server knows."""
    request = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), texts)))
    prompt_kind = draw(st.sampled_from(["text", "text", "ids", "ids", "none"]))
    if prompt_kind == "text":
        request.text = draw(mostly(texts.filter(bool), texts))
    elif prompt_kind == "ids":
        ids = mostly(st.integers(0, 257), int64s)
        request.token_ids.ids.extend(draw(st.lists(ids, min_size=draw(st.integers(0, 1)))))
    sampling = request.sampling
    for name, values in SAMPLING_VALUES.items():
        if draw(st.booleans()):
            setattr(sampling, name, draw(values))
    stops = mostly(st.lists(texts.filter(bool), max_size=3), st.lists(texts, max_size=40))
    sampling.stop.extend(draw(stops))
    sampling.stop_token_ids.extend(draw(st.lists(mostly(st.integers(0, 257), int64s), max_size=5)))
    sampling.ignore_eos = draw(st.booleans())
    request.cache_salt = draw(st.one_of(st.just(""), texts))
    payload = request.SerializeToString()
    corruption = draw(st.sampled_from(["none"] * 5 + ["invalid-utf8", "unknown-field", "cut"]))
    if corruption == "invalid-utf8":  # field 2 (text), 3 bytes that are not UTF-8
        payload += bytes([0x12, 0x03, 0xFF, 0xFE, 0xC3])
    elif corruption == "unknown-field":  # field 99, varint
        payload += bytes([0x98, 0x06, 0x07])
    elif corruption == "cut" and payload:
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    return payload


def known_bad(**sampling) -> bytes:
    """Requests that once stopped the server: the fuzzing always tries these first."""
    request = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(**sampling))
    return request.SerializeToString()


@example(payload=known_bad(temperature=math.nan), read_before_cancel=None)
@example(payload=known_bad(temperature=5e-324, max_tokens=8), read_before_cancel=None)
@example(payload=known_bad(temperature=1.0, max_tokens=2**62), read_before_cancel=None)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=generate_requests(), read_before_cancel=st.none() | st.integers(0, 3))
def test_fuzzed_requests_never_stop_the_server(server, payload, read_before_cancel):
    _, address = server
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            "/kvray.v1.Engine/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.GenerateResponse.FromString,
        )(payload, timeout=60)
        try:
            for index, _ in enumerate(call):
                if read_before_cancel is not None and index >= read_before_cancel:
                    call.cancel()
                    break
        except grpc.RpcError:
            pass
        assert call.code() in ACCEPTABLE, (call.code(), call.details())


def test_after_the_fuzzing_every_block_is_back_and_the_server_serves(server):
    assert_still_serving(*server)


# -- load ------------------------------------------------------------------------------------


async def health_latencies(address: str, done: asyncio.Event) -> list[float]:
    latencies = []
    async with AsyncClient(address, timeout=30) as client:
        while not done.is_set():
            started = time.perf_counter()
            assert await client.health() == "SERVING"
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.1)
    return latencies


def test_400_sampled_streams_finish_while_health_answers(server):
    handle, address = server

    async def main():
        async with AsyncClient(address, timeout=300) as client:

            async def one(index: int) -> int:
                tokens = 0
                async for delta in client.stream(
                    f"load {index}: " + "x" * (index % 50),
                    max_tokens=16,
                    temperature=1.0,
                    top_p=0.9,
                    seed=index if index % 2 else None,
                    ignore_eos=True,
                ):
                    tokens += len(delta.token_ids)
                return tokens

            done = asyncio.Event()
            probe = asyncio.create_task(health_latencies(address, done))
            counts = await asyncio.gather(*(one(i) for i in range(400)))
            done.set()
            return counts, await probe

    counts, latencies = asyncio.run(main())
    assert counts == [16] * 400
    assert latencies and max(latencies) < 1.0, max(latencies)
    assert_still_serving(handle, address)


def test_a_storm_of_cancelled_streams_gives_every_block_back(server):
    handle, address = server

    async def main():
        async with AsyncClient(address, timeout=300) as client:

            async def cancel_after_first(index: int) -> None:
                stream = client.stream(
                    [10 + index % 200] * (20 + index % 60), max_tokens=150, ignore_eos=True
                )
                async for _ in stream:
                    break
                await stream.aclose()

            await asyncio.gather(*(cancel_after_first(i) for i in range(100)))

    asyncio.run(main())
    assert_still_serving(handle, address)
