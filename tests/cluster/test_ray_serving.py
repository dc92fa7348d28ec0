"""Serving through the Ray controller on a real local Ray cluster: TP=1 and TP=2 give the
in-process engine's greedy tokens through either step transport (a compiled graph, the
default, or one actor call per rank), and so do two pipeline stages (of one or two TP ranks,
over step channels or Ray calls), with a step of each micro-batch in flight; at PP 2 x TP 2 a
hybrid and an MLA model give transformers' tokens, and n-gram drafts are verified through
the stages; losing a worker, of any stage, fails in-flight requests promptly and the group is
rebuilt, with its graph; a split into stages that cannot be made is refused before anything
is placed."""

from __future__ import annotations

import json
import time

import pytest
import ray

from cluster.client import Client
from cluster.config import EngineConfig
from cluster.controller import start_controller
from cluster.local import LocalServer
from cluster.placement import cpus_per_worker
from cluster.transport import STEP_TRANSPORTS
from tests.cluster.ray_helpers import (
    BASE,
    PROMPTS,
    generate_all,
    greedy_tokens,
    long_stream,
    serve,
    stop,
    wait_until_serving,
)
from tests.workers.hf_models import PROMPTS as HF_PROMPTS
from tests.workers.hf_models import reference_generations, save_nemotron_h
from tests.workers.stage_helpers import save_stage_checkpoint


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference_tokens():
    with LocalServer(EngineConfig(**BASE)) as server:
        return greedy_tokens(server.address)


# Socket at TP 1 is the default on CPUs: every other Ray test here and in test_serving_behaviour,
# test_cli and test_serve_replicas (a worker that dies included) runs on it.
TRANSPORTS = [(1, "compiled_graph"), (2, "compiled_graph"), (2, "actor_calls"), (2, "socket")]


@pytest.mark.parametrize("tp,transport", TRANSPORTS)
def test_controller_serves_the_same_tokens(local_ray, reference_tokens, tp, transport):
    cpus = 3 - tp  # TP 1 on two CPUs; TP 2 on one each
    handle, address = serve(
        tensor_parallel_size=tp, kv_cache_layout="BLHNC", cpus_per_worker=cpus,
        step_transport=transport,
    )  # fmt: skip
    try:
        assert (
            ray.get(handle.stats.remote())["step_transport"] == STEP_TRANSPORTS[transport].__name__
        )
        workers = ray.get(handle.worker_handles.remote())
        # Each rank computes on as many torch threads as its bundle holds CPUs.
        assert [ray.get(w.health.remote())["num_threads"] for w in workers] == [cpus] * tp
        assert greedy_tokens(address) == reference_tokens
        with Client(address) as client:
            info = client.info()
            assert info["tensor_parallel_size"] == tp
            assert info["kv_cache_layout"] == "BLHNC"
            deltas = list(client.stream("streamed", max_tokens=8, temperature=0))
            assert sum(len(d.token_ids) for d in deltas) == 8
    finally:
        stop(handle)


@pytest.mark.parametrize("tp,transport", TRANSPORTS)
def test_a_lost_worker_fails_its_streams_and_the_group_is_rebuilt(
    local_ray, reference_tokens, tp, transport
):
    handle, address = serve(tensor_parallel_size=tp, step_transport=transport)
    try:
        thread, errors, first_token = long_stream(address)
        assert first_token.wait(timeout=60)
        workers = ray.get(handle.worker_handles.remote())
        killed_at = time.monotonic()
        ray.kill(workers[-1])
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert time.monotonic() - killed_at < 15
        assert errors and "lost a worker" in str(errors[0])

        wait_until_serving(address, since=killed_at)
        assert greedy_tokens(address) == reference_tokens  # a fresh cache, the same model
        stats = ray.get(handle.stats.remote())
        assert stats["num_rebuilds"] == 1 and stats["state"] == "serving"
        assert stats["step_transport"] == STEP_TRANSPORTS[transport].__name__
        assert stats["num_free_blocks"] == stats["num_usable_blocks"]
        new_workers = ray.get(handle.worker_handles.remote())
        assert len(new_workers) == tp and not set(new_workers) & set(workers)
    finally:
        stop(handle)


def test_by_default_cpu_ranks_share_the_node(local_ray):
    assert cpus_per_worker(EngineConfig(tensor_parallel_size=2), use_gpu=False) == 2
    assert cpus_per_worker(EngineConfig(tensor_parallel_size=3), use_gpu=False) == 1
    assert cpus_per_worker(EngineConfig(tensor_parallel_size=2), use_gpu=True) == 1
    assert cpus_per_worker(EngineConfig(cpus_per_worker=3), use_gpu=False) == 3


def test_the_step_transport_defaults_to_a_compiled_graph_beside_gpus_only():
    # A compiled graph's readers spin on a core each, which CPU workers compute with.
    assert EngineConfig().for_workers_on(use_gpu=True).step_transport == "compiled_graph"
    assert EngineConfig().for_workers_on(use_gpu=False).step_transport == "socket"
    chosen = EngineConfig(step_transport="compiled_graph").for_workers_on(use_gpu=False)
    assert chosen.step_transport == "compiled_graph"
    with pytest.raises(ValueError, match="step_transport"):
        EngineConfig(step_transport="shared_memory")
    # No compiled graph serves pipeline stages: their steps go over step channels.
    staged = EngineConfig(pipeline_parallel_size=2).for_workers_on(use_gpu=True)
    assert staged.step_transport == "socket"
    with pytest.raises(ValueError, match="compiled_graph does not serve pipeline stages"):
        EngineConfig(pipeline_parallel_size=2, step_transport="compiled_graph")


def test_placement_that_can_never_fit_fails_at_once(local_ray):
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        start_controller(EngineConfig(**BASE, tensor_parallel_size=8))
    assert time.monotonic() - started < 30  # not the placement timeout
    assert "Cannot place 8 TP rank(s) of {'CPU': 1}" in str(info.value)
    assert "8 CPU in all; the cluster has 4" in str(info.value)


@ray.remote(num_cpus=3)
class Busy:
    def ready(self) -> bool:
        return True


def test_placement_that_cannot_fit_now_waits_then_says_what_was_asked(local_ray):
    busy = Busy.remote()
    ray.get(busy.ready.remote())
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            start_controller(EngineConfig(**BASE, tensor_parallel_size=2, placement_timeout_s=3))
    finally:
        ray.kill(busy)
    message = str(info.value)
    assert "Could not place 2 TP rank(s) of {'CPU': 1}" in message
    assert "The cluster has" in message and "'CPU': 4.0" in message


STAGED = {"socket": "SocketStagedTransport", "actor_calls": "StagedTransport"}


@pytest.mark.parametrize("tp,transport", [(1, "socket"), (2, "socket"), (1, "actor_calls")])
def test_two_stages_serve_the_tokens_of_one(local_ray, reference_tokens, tp, transport):
    handle, address = serve(
        pipeline_parallel_size=2, tensor_parallel_size=tp, step_transport=transport
    )
    try:
        assert ray.get(handle.stats.remote())["step_transport"] == STAGED[transport]
        workers = ray.get(handle.worker_handles.remote())
        assert len(workers) == 2 * tp
        assert greedy_tokens(address) == reference_tokens
        with Client(address) as client:
            deltas = list(client.stream("streamed", max_tokens=8, temperature=0))
            assert sum(len(d.token_ids) for d in deltas) == 8
            info = client.info()
            assert (info["tensor_parallel_size"], info["pipeline_parallel_size"]) == (tp, 2)
        # Sent at once, the requests split into two micro-batches, one step of each in flight.
        assert generate_all(address, PROMPTS * 2) == reference_tokens * 2
        assert ray.get(handle.stats.remote())["most_steps_in_flight"] == 2
    finally:
        stop(handle)


@pytest.mark.parametrize("lost", [0, -1])  # the first stage's worker or the last's
def test_a_lost_stage_fails_its_streams_and_the_group_is_rebuilt(local_ray, reference_tokens, lost):
    handle, address = serve(pipeline_parallel_size=2)
    try:
        thread, errors, first_token = long_stream(address)
        assert first_token.wait(timeout=60)
        workers = ray.get(handle.worker_handles.remote())
        killed_at = time.monotonic()
        ray.kill(workers[lost])  # the other stage waits on hidden states, or to send them
        thread.join(timeout=60)
        assert not thread.is_alive() and time.monotonic() - killed_at < 15
        assert errors and "lost a worker" in str(errors[0])
        wait_until_serving(address, since=killed_at)
        assert greedy_tokens(address) == reference_tokens
        stats = ray.get(handle.stats.remote())
        assert stats["num_rebuilds"] == 1 and stats["num_free_blocks"] == stats["num_usable_blocks"]
        assert not set(ray.get(handle.worker_handles.remote())) & set(workers)
    finally:
        stop(handle)


def test_more_stages_than_layers_are_refused_before_placing(local_ray):
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(Exception, match="asks for more stages than the model has decoder layers"):
        serve(pipeline_parallel_size=5)
    assert ray.available_resources().get("CPU", 0) >= free  # nothing was left reserved


@pytest.mark.parametrize("name", ["llama", "nemotron-h", "deepseek"])
def test_two_stages_of_two_ranks_give_transformers_tokens(local_ray, tmp_path, name):
    """A dense Llama in LHBNC, a NemotronH (Mamba and attention on both stages) and a
    DeepSeek (MLA) in BLHNC at PP 2 x TP 2, the prompts sent at once and chunked (16 tokens
    a step)."""
    model_dir, layout, _ = save_stage_checkpoint(name, tmp_path)
    handle, address = serve(
        model=str(model_dir), pipeline_parallel_size=2, tensor_parallel_size=2,
        kv_cache_layout=layout, max_num_batched_tokens=16,
    )  # fmt: skip
    try:
        expected = reference_generations(model_dir, HF_PROMPTS, 8)
        assert generate_all(address, HF_PROMPTS, max_tokens=8) == expected
    finally:
        stop(handle)


def test_two_stages_verify_ngram_drafts_one_step_at_a_time(local_ray, tmp_path):
    """Speculative decoding through stages: a hybrid whose rejected drafts are undone on both
    stages (the first learns what was kept with the next step) gives transformers' tokens;
    a verifying step's tokens are unknown until it returns, so steps go one at a time."""
    model_dir = save_nemotron_h(tmp_path, "M*-M*-", n_groups=2, initializer_range=0.1)
    prompts = [prompt + prompt for prompt in HF_PROMPTS]  # drafts from the start
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    handle, address = serve(
        model=str(model_dir), pipeline_parallel_size=2, block_size=4, mamba_state_interval=8,
        speculative_config=json.dumps({**speculative, "prompt_lookup_min": 1}),
    )  # fmt: skip
    try:
        expected = reference_generations(model_dir, prompts, 24)
        assert generate_all(address, prompts, max_tokens=24) == expected
        with Client(address) as client:
            info = client.info()
        accepted = info["spec_decode_num_accepted_tokens"]
        assert 0 < accepted < info["spec_decode_num_draft_tokens"]  # some kept, some undone
        assert ray.get(handle.stats.remote())["most_steps_in_flight"] == 1
    finally:
        stop(handle)
