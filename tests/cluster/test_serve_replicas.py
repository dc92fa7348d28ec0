"""Engine replicas on Ray Serve, on a real two-node Ray cluster: two replicas answer what one
engine answers; the KV-aware router keeps each shared prefix on the replica that caches it
(against round-robin, on caches too small to hold every prefix twice); a replica whose worker
dies is replaced while the other serves on; autoscaling adds a replica under load and takes
it away after. Every request goes through the kvray gRPC API of the application's ingress."""

from __future__ import annotations

import importlib
import os
import random
import re
import threading

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from cluster.client import Client, UnavailableError
from cluster.config import EngineConfig
from cluster.local import LocalServer
from cluster.serve import app
from tests.cluster.serve_helpers import deploy, replicas, run_application, start_serve, wait_for
from tests.deploy.manifests import rayservice_application

# Each replica's cache: 100 blocks of 16 tokens (the tiny model's page is 64 KiB), fewer
# than the workload's nine 256-token prefixes take (144 blocks).
BLOCK_BYTES = 64 << 10
SMALL = dict(kv_cache_memory_bytes=101 * BLOCK_BYTES, max_model_len=512)
PREFIX_LEN, NUM_PREFIXES, NUM_ROUNDS = 256, 9, 6


@pytest.fixture(scope="module")
def http_port():
    # Replicas and handles report requests in flight every 10 s by default; the autoscaling
    # test looks back over 2 s.
    pushes = [
        f"RAY_SERVE_{who}_AUTOSCALING_METRIC_PUSH_INTERVAL_S" for who in ("REPLICA", "HANDLE")
    ]
    os.environ.update(dict.fromkeys(pushes, "0.5"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield start_serve()
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    for name in pushes:
        os.environ.pop(name)


def test_two_replicas_answer_what_one_engine_answers(http_port):
    prompts = [[(7 * i + j) % 250 for j in range(10 + 13 * i)] for i in range(6)]
    config = EngineConfig(port=0, **SMALL)
    with LocalServer(config) as one, Client(one.address) as client:
        expected = [client.generate(p, max_tokens=8, temperature=0) for p in prompts]
    address = deploy(http_port, data_parallel_size=2, **SMALL)
    with Client(address) as client:
        answers = [client.generate(p, max_tokens=8, temperature=0).token_ids for p in prompts]
    assert answers == [e.token_ids for e in expected]
    # The OpenAI API, through Serve's HTTP proxy and the ingress.
    body = {"model": "embedded:tiny", "prompt": prompts[0], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected[0].text
    # A constrained request: compiled (checked) at the ingress, matched on a replica's rank 0;
    # a constraint that does not compile never reaches a replica.
    constrained = {**body, "structured_outputs": {"regex": "[a-z]{3}"}, "temperature": 1.0}
    reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=constrained, timeout=60)
    assert reply.status_code == 200, reply.text
    assert re.fullmatch("[a-z]{3}", reply.json()["choices"][0]["text"])
    bad = {**body, "structured_outputs": {"regex": "(unclosed"}}
    reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=bad, timeout=60)
    assert reply.status_code == 400 and "parenthesis" in reply.json()["error"]["message"]
    wait_for(
        lambda: sum(r["num_requests_finished"] for r in replicas(address).values()) == 8,
        what="both replicas' reports of the eight requests",
    )
    with Client(address) as client:
        info = client.info()
    with LocalServer(config) as alone, Client(alone.address) as client:
        one_engine = client.info()
    # Blocks and capacity are both replicas' together, as the free blocks are.
    assert info["num_blocks"] == 2 * one_engine["num_blocks"] >= info["num_free_blocks"]
    assert info["capacity_tokens"] == 2 * one_engine["capacity_tokens"]
    # /metrics: each replica's series under its id, and the totals.
    ids = set(replicas(address))
    metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=30).text
    finished = {
        dict(s.labels).get("replica"): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "kvray:request_success_total" and s.labels["finished_reason"] == "length"
    }
    assert set(finished) == ids | {None} and finished[None] == 7
    assert sum(finished[i] for i in ids) == 7 and all(finished[i] > 0 for i in ids)


def shared_prefix_workload(seed: int = 0) -> list[list[int]]:
    """Nine 256-token prefixes in six interleaved rounds, each request with its own suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(250) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    return [
        [*prefix, *(rng.randrange(250) for _ in range(8))]
        for _ in range(NUM_ROUNDS)
        for prefix in prefixes
    ]


def cached_tokens_under(http_port: int, policy: str) -> tuple[int, dict[str, int]]:
    address = deploy(http_port, data_parallel_size=2, routing_policy=policy, **SMALL)
    with Client(address) as client:
        assert client.info()["routing_policy"] == policy
        cached = sum(
            client.generate(prompt, max_tokens=2, temperature=0).usage.cached_prompt_tokens
            for prompt in shared_prefix_workload()
        )
    wait_for(
        lambda: sum(r["num_requests_finished"] for r in replicas(address).values()) >= 54,
        what="every replica's report of its finished requests",
    )
    return cached, {i: r["num_requests_finished"] for i, r in replicas(address).items()}


def test_kv_aware_routing_keeps_each_prefix_where_it_is_cached(http_port):
    ideal = NUM_PREFIXES * (NUM_ROUNDS - 1) * PREFIX_LEN  # each prefix computed once
    kv_aware, finished = cached_tokens_under(http_port, "kv-aware")
    round_robin, _ = cached_tokens_under(http_port, "round-robin")
    assert kv_aware >= 0.8 * ideal, (kv_aware, ideal)
    assert kv_aware >= 2 * round_robin, (kv_aware, round_robin)
    total = NUM_PREFIXES * NUM_ROUNDS
    assert all(n >= 0.3 * total for n in finished.values()), finished


def test_a_replica_whose_worker_dies_is_replaced_while_the_other_serves(http_port, monkeypatch):
    # Reports far apart: the router goes on taking the dead replica for a live one a while.
    monkeypatch.setattr(app, "ROUTING_STATS_PERIOD_S", 2.5)
    address = deploy(http_port, data_parallel_size=2, **SMALL)
    before = set(replicas(address))
    outcomes: list[str] = []
    started = threading.Semaphore(0)

    def stream(index: int) -> None:
        try:
            with Client(address, timeout=120) as client:
                prompt = [index + 1] * (20 + index)
                deltas = client.stream(prompt, max_tokens=300, ignore_eos=True, temperature=0)
                for number, _ in enumerate(deltas):
                    if number == 0:
                        started.release()
            outcomes.append("finished")
        except UnavailableError:
            outcomes.append("unavailable")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for _ in threads:  # every stream running (two per replica: the router spreads them)
        assert started.acquire(timeout=120)
    # One replica's worker (whichever replica the router picks for the call).
    engine_replicas = serve.get_deployment_handle("EngineReplica", app_name=app.APP_NAME)
    ray.kill(engine_replicas.worker_actors.remote().result()[0])
    wait_for(lambda: outcomes.count("unavailable") == 2, what="the lost replica's streams failing")
    # Before the router has the dead replica's report, which is then the least loaded: new
    # requests are still answered, by the replica that serves.
    with Client(address) as client:
        assert all(
            len(client.generate([9, 9, i], max_tokens=3, temperature=0).token_ids) == 3
            for i in range(4)
        )
    for thread in threads:
        thread.join(timeout=180)
    assert sorted(outcomes) == ["finished", "finished", "unavailable", "unavailable"], outcomes
    wait_for(lambda: len(set(replicas(address)) - before) == 1, what="the replacement replica")
    (new,) = set(replicas(address)) - before
    with Client(address) as client:
        for i in range(6):  # fresh prefixes go to the emptier cache: the new replica's
            client.generate([100 + i] * 40, max_tokens=2, temperature=0)
    wait_for(lambda: replicas(address)[new]["num_requests_finished"] > 0, what="it serving")


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(http_port, monkeypatch):
    monkeypatch.setattr(app, "AUTOSCALE_LOOK_BACK_S", 2.0)
    monkeypatch.setattr(app, "DOWNSCALE_DELAY_S", 3.0)
    address = deploy(http_port, autoscale="1:2", target_ongoing_requests=1, **SMALL)
    assert len(replicas(address)) == 1
    done = threading.Event()

    def load(index: int) -> None:
        with Client(address, timeout=300) as client:
            while not done.is_set():
                client.generate([index + 3] * 30, max_tokens=40, ignore_eos=True)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(replicas(address)) == 2, what="a second replica", timeout=180)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)
    wait_for(lambda: len(replicas(address)) == 1, what="back to one replica", timeout=180)


def test_the_rayservice_application_serves_with_its_ingress_on_the_head(http_port):
    """deploy/rayservice-replicas.yaml's application, built as a RayService builds it: from
    its import path and args, with the model and GPU settings swapped for this machine's."""
    application = rayservice_application()
    module, _, name = application.import_path.partition(":")
    build = getattr(importlib.import_module(module), name)
    args = {key: value for key, value in application.args.items() if "kv-cache" not in key}
    args |= {
        "model": "embedded:tiny",
        "tensor-parallel-size": 1,
        "attention-backend": "torch",
        "cpus-per-worker": 1,
        "kv-cache-memory": SMALL["kv_cache_memory_bytes"],
        "max-model-len": 512,
        "placement-strategy": "PACK",
        "host": "127.0.0.1",
        "port": 0,
    }
    address = run_application(build(args), expected_replicas=1)  # autoscale's minimum
    with Client(address) as client:
        assert len(client.generate([5, 6, 7], max_tokens=4).token_ids) == 4
        assert client.info()["data_parallel_size"] == 1
    (head,) = [n for n in ray.nodes() if app.HEAD_NODE in n["Resources"]]
    (ingress,) = list_actors(
        filters=[("class_name", "=", "ServeReplica:kvray:Ingress"), ("state", "=", "ALIVE")]
    )
    assert ingress.node_id == head["NodeID"]
