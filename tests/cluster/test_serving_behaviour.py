"""The request path end to end, through the real gRPC server and client, for each way kvray
serves (in process; Ray controller at TP 1 and TP 2): streaming, continuous batching (concurrent
requests give the tokens they give alone), prefix-cache accounting, preemption, abort and
disconnect, bad input, queue limits and the API key."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import ray

from cluster.api.v1 import kvray_pb2 as pb
from cluster.api.v1 import kvray_pb2_grpc as pb_grpc
from cluster.client import (
    AsyncClient,
    Client,
    InvalidRequestError,
    OverloadedError,
    UnauthenticatedError,
)
from tests.cluster.servers import KINDS, start_server

BASE = dict(
    cpus_per_worker=1,  # the preemption test runs a second engine beside the first
    kv_cache_memory_bytes=8 << 20,
    port=0,
    max_model_len=256,
    block_size=16,
    max_num_batched_tokens=64,
)
PROMPTS = [f"request number {i}: " + "abc" * (i % 5) for i in range(32)]


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request):
    if request.param.startswith("ray"):
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        yield request.param
        ray.shutdown()
    else:
        yield request.param


@pytest.fixture(scope="module")
def server(kind):
    running = start_server(kind, **BASE)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def free_blocks(server) -> int:
    return server.stats()["num_free_blocks"]


def test_streaming_delivers_tokens_then_a_final_message(client):
    deltas = list(client.stream("stream me", max_tokens=10, temperature=0))
    assert sum(len(d.token_ids) for d in deltas) == 10
    assert len(deltas) >= 2  # tokens arrive as they are made, not all at the end
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    final = deltas[-1]
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 10)
    assert (
        "".join(d.text for d in deltas)
        == client.generate("stream me", max_tokens=10, temperature=0).text
    )


def test_concurrent_requests_match_their_solo_runs(server, client):
    solo = {p: client.generate(p, max_tokens=12, temperature=0).token_ids for p in PROMPTS[:8]}
    results: dict[str, list[int]] = {}

    def run(prompt):
        with Client(server.address, timeout=120) as own:
            results[prompt] = own.generate(prompt, max_tokens=12, temperature=0).token_ids

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(results) == 32
    assert {p: results[p] for p in solo} == solo
    for prompt in PROMPTS[8:]:
        assert results[prompt] == client.generate(prompt, max_tokens=12, temperature=0).token_ids


def test_repeated_prompt_reports_cached_prompt_tokens(client):
    prompt = list(range(40, 90))  # 50 tokens: three full blocks of 16
    first = client.generate(prompt, max_tokens=4, temperature=0)
    second = client.generate(prompt, max_tokens=4, temperature=0)
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == 48
    assert second.token_ids == first.token_ids
    # A tenant's salt keeps its prompts apart from the shared cache and other tenants'.
    salted = client.generate(prompt, max_tokens=4, temperature=0, cache_salt="tenant-a")
    again = client.generate(prompt, max_tokens=4, temperature=0, cache_salt="tenant-a")
    other = client.generate(prompt, max_tokens=4, temperature=0, cache_salt="tenant-b")
    assert salted.usage.cached_prompt_tokens == 0 and other.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens == 48
    assert salted.token_ids == again.token_ids == other.token_ids == first.token_ids


def test_bad_inputs_are_refused_while_others_keep_streaming(server, client):
    background = client.stream("keep going", max_tokens=40, temperature=0)
    first = next(background)
    bad = [
        ({"prompt": "x" * 300}, "at most 255"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt": ""}, "empty"),
        ({"prompt": [999999]}, r"\[0, 258\)"),
    ]
    for kwargs, message in bad:
        prompt = kwargs.pop("prompt")
        with pytest.raises(InvalidRequestError, match=message):
            client.generate(prompt, **kwargs)
    rest = list(background)
    assert sum(len(d.token_ids) for d in [first, *rest]) == 40
    assert rest[-1].finish_reason == "length"


def test_unknown_fields_and_missing_prompt_are_invalid(server):
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.EngineStub(channel)
    request = pb.GenerateRequest(text="hi")
    raw = request.SerializeToString() + bytes([0xA8, 0x06, 0x01])  # field 101, varint 1
    call = channel.unary_stream(
        "/kvray.v1.Engine/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call(raw))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fields this server does not know" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_abort_and_disconnect_return_every_block(server, client):
    idle = free_blocks(server)
    stream = client.stream("abort me", request_id="to-abort", max_tokens=200, temperature=0)
    next(stream)
    assert client.abort("to-abort") is True
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert client.abort("to-abort") is False

    dropped = client.stream("walk away", max_tokens=200, temperature=0)
    next(dropped)
    dropped.close()  # the client stops reading: the call is cancelled
    deadline = time.monotonic() + 30
    while free_blocks(server) != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_blocks(server) == idle


def test_async_client(server):
    async def main():
        async with AsyncClient(server.address) as client:
            done = await client.generate([1, 2, 3, 4], max_tokens=6, temperature=0)
            deltas = [d async for d in client.stream([1, 2, 3, 4], max_tokens=6, temperature=0)]
            info = await client.info()
            return done, deltas, info

    done, deltas, info = asyncio.run(main())
    assert len(done.token_ids) == 6
    assert [t for d in deltas for t in d.token_ids] == done.token_ids
    assert info["num_blocks"] > 0 and info["kv_cache_layout"] == "LBHNC"


def test_server_info_and_health(kind, client):
    client_kind = kind
    info = client.info()
    assert info["model"] == "embedded:tiny"
    assert info["tensor_parallel_size"] == KINDS[client_kind][1]
    assert info["pipeline_parallel_size"] == 1
    assert info["scheduler_block_size"] == 16
    assert info["groups"][0]["spec_type"] == "FullAttentionSpec"
    assert len(info["groups"][0]["layer_names"]) == 4
    assert 0 < info["num_free_blocks"] < info["num_blocks"]
    assert info["capacity_tokens"] > 0
    assert info["vocab_size"] == 258
    assert info["num_steps"] > 0 and info["step_overhead_median_ms"] > 0
    assert 0 <= info["kv_memory_waste"] < 1
    assert client.health() == "SERVING"


def test_preemption_under_a_tiny_cache_keeps_the_tokens(kind, client):
    """Greedy and seeded requests alike: a preempted seeded request continues its generator
    rather than starting it again, so it gives the tokens it gives alone."""
    prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
    sampling = [
        dict(temperature=0),
        dict(temperature=1.0, top_p=0.95, seed=5),
        dict(temperature=0),
        dict(temperature=0.7, top_k=40, seed=9),
    ]
    expected = [
        client.generate(p, max_tokens=40, **s).token_ids
        for p, s in zip(prompts, sampling, strict=True)
    ]
    small = start_server(kind, **{**BASE, "num_gpu_blocks_override": 12, "max_model_len": 128})
    try:
        results = {}

        def run(index):
            with Client(small.address, timeout=300) as own:
                results[index] = own.generate(
                    prompts[index], max_tokens=40, **sampling[index]
                ).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert small.stats()["num_preemptions"] > 0
    finally:
        small.stop()
    assert [results[i] for i in range(4)] == expected


def test_queue_limit_and_api_key(kind):
    locked = start_server(kind, **{**BASE, "max_queue_len": 0, "api_key": "s3cret"})
    try:
        with Client(locked.address) as anonymous:
            with pytest.raises(UnauthenticatedError, match="API key"):
                anonymous.generate("hi", max_tokens=1)
            with pytest.raises(UnauthenticatedError):
                anonymous.info()
            assert anonymous.health() == "SERVING"  # probes need no key
        with Client(locked.address, api_key="wrong") as wrong, pytest.raises(UnauthenticatedError):
            wrong.generate("hi", max_tokens=1)
        with Client(locked.address, api_key="s3cret") as keyed:
            with pytest.raises(OverloadedError, match="retry later"):
                keyed.generate("hi", max_tokens=1)
            assert keyed.info()["model"] == "embedded:tiny"
    finally:
        locked.stop()
