"""The ``kvray bench`` modes. Each returns rows (dicts) for the report."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import msgspec
import torch

from cluster.bench.decode_cost import decode_cost
from cluster.bench.measure import latency_summary, run_requests
from cluster.bench.workload import (
    ideal_cached_tokens,
    multi_tenant_requests,
    random_requests,
    shared_prefix_requests,
)
from cluster.client import Client
from cluster.config import EngineConfig
from cluster.launch import running_engine
from kvcore.views import TORCH_DTYPES
from workers.model_source import model_config_for

ENGINE_STAT_KEYS = (
    "kv_memory_waste",
    "step_overhead_median_ms",
    "step_overhead_p99_ms",
    "num_steps",
)


@contextmanager
def engine(config: EngineConfig, args):
    """The engine a run measures, and its label: a running server (``--server``, the client
    here, the engine in its own processes), else one started here on Ray (as ``kvray serve``
    runs it), or in this process (``--in-process``: the client shares its interpreter)."""
    server = getattr(args, "server", None)
    if server is not None:
        yield server, f"kvray (server {server})"
        return
    in_process = getattr(args, "in_process", False)
    label = "in-process" if in_process else "ray"
    parallel = f"TP {config.tensor_parallel_size}"
    if config.pipeline_parallel_size > 1:
        parallel = f"PP {config.pipeline_parallel_size} x {parallel}"
    with running_engine(msgspec.structs.replace(config, port=0), in_process=in_process) as address:
        yield address, f"kvray ({label}, {parallel})"


def engine_stats(address: str, api_key: str | None = None) -> dict:
    with Client(address, api_key=api_key) as client:
        info = client.info()
    return {key: info[key] for key in ENGINE_STAT_KEYS}


def throughput(config: EngineConfig, args) -> list[dict]:
    vocab = model_config_for(config.model).vocab_size
    requests = random_requests(
        args.num_prompts, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed
    )
    api_key = getattr(args, "api_key", None)
    with engine(config, args) as (address, label):
        timings, wall = asyncio.run(run_requests(address, requests, api_key=api_key))
        stats = engine_stats(address, api_key)
    output_tokens = sum(t.num_output_tokens for t in timings)
    total_tokens = output_tokens + sum(t.num_prompt_tokens for t in timings)
    latencies = latency_summary(timings, wall)
    rows = [
        {
            "engine": label,
            "requests": len(timings),
            "duration_s": wall,
            "output_tokens_per_s": output_tokens / wall,
            "total_tokens_per_s": total_tokens / wall,
            # Decode speed apart from the prefill (a peer's "eval" rate is this one).
            "ttft_ms_median": latencies["ttft_ms_median"],
            "tpot_ms_median": latencies["tpot_ms_median"],
            **stats,
        }
    ]
    if args.compare == "transformers":
        from cluster.bench.hf_baseline import hf_generate_throughput

        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        dtype = TORCH_DTYPES[config.model_dtype(model_config_for(config.model).dtype)]
        baseline = hf_generate_throughput(
            config.model, requests, args.hf_batch_size, device=device, dtype=dtype
        )
        baseline["kvray_speedup"] = rows[0]["output_tokens_per_s"] / baseline["output_tokens_per_s"]
        rows.append(baseline)
    return rows


def serve(args) -> list[dict]:
    """Against a running server (its model's vocabulary is read from GetServerInfo): random
    prompts, or ``--workload multi-tenant`` (shared system prompts), which also reports the
    prompt tokens served from the cache against what a cache that never evicts would serve,
    and how the requests spread over the server's replicas."""
    with Client(args.server, api_key=args.api_key) as client:
        before = client.info()
    vocab = before["vocab_size"]
    if args.workload == "multi-tenant":
        pairs = multi_tenant_requests(
            args.num_prompts,
            args.num_tenants,
            args.system_prompt_len,
            args.user_len,
            args.output_len,
            vocab_size=vocab,
            seed=args.seed,
        )
        requests = [request for _, request in pairs]
    else:
        requests = random_requests(
            args.num_prompts, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed
        )
    timings, wall = asyncio.run(
        run_requests(
            args.server,
            requests,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            api_key=args.api_key,
        )
    )
    after = settled_info(args.server, args.api_key, before, len(timings))
    row = {
        "workload": args.workload,
        "replicas": max(after["data_parallel_size"], 1),
        "routing_policy": after["routing_policy"] or "-",
        "request_rate": args.request_rate,
        **latency_summary(timings, wall),
    }
    if args.workload == "multi-tenant":
        prompt_tokens = sum(t.num_prompt_tokens for t in timings)
        cached = sum(t.num_cached_tokens for t in timings)
        ideal = ideal_cached_tokens(
            [tenant for tenant, _ in pairs], args.system_prompt_len, after["scheduler_block_size"]
        )
        row |= {
            "cached_prompt_tokens": cached,
            "cached_share": cached / prompt_tokens,
            "ideal_cached_share": ideal / prompt_tokens,
            "of_ideal": cached / ideal if ideal else 0.0,
            "finished_per_replica": "/".join(
                map(str, finished_per_replica(before, after, len(timings)))
            ),
        }
    return [row | {key: after[key] for key in ENGINE_STAT_KEYS}]


def settled_info(server: str, api_key: str | None, before: dict, num_requests: int) -> dict:
    """GetServerInfo once every replica's report counts the run's requests (replicas report
    every half second; one engine's reply is current)."""
    with Client(server, api_key=api_key) as client:
        deadline = time.monotonic() + 5.0
        while True:
            after = client.info()
            done = sum(finished_per_replica(before, after, num_requests))
            if done >= num_requests or time.monotonic() > deadline:
                return after
            time.sleep(0.1)


def finished_per_replica(before: dict, after: dict, num_requests: int) -> list[int]:
    """Requests each replica finished between two GetServerInfo replies (one engine: all)."""
    if not after["replicas"]:
        return [num_requests]
    earlier = {r["replica_id"]: r["num_requests_finished"] for r in before["replicas"]}
    return [r["num_requests_finished"] - earlier.get(r["replica_id"], 0) for r in after["replicas"]]


def prefix(config: EngineConfig, args) -> list[dict]:
    """A shared-prefix workload with caching on and off, and a 0%-hit workload with caching
    on (what caching costs when nothing hits)."""
    vocab = model_config_for(config.model).vocab_size
    prompt_len = args.prompt_len
    shared_len = int(prompt_len * args.shared_fraction)
    workloads = {
        "shared": shared_prefix_requests(
            args.num_prompts,
            shared_len,
            prompt_len - shared_len,
            args.output_len,
            vocab_size=vocab,
            seed=args.seed,
        ),
        "no-hit": shared_prefix_requests(
            args.num_prompts, 0, prompt_len, args.output_len, vocab_size=vocab, seed=args.seed
        ),
    }
    rows = []
    for workload, caching in (
        ("shared", True),
        ("shared", False),
        ("no-hit", True),
        ("no-hit", False),
    ):
        requests = workloads[workload]
        run_config = msgspec.structs.replace(config, enable_prefix_caching=caching)
        with engine(run_config, args) as (address, _):
            # One request first, so the shared prefix is cached before the measured ones.
            asyncio.run(run_requests(address, requests[:1]))
            timings, wall = asyncio.run(run_requests(address, requests[1:]))
            stats = engine_stats(address)
        summary = latency_summary(timings, wall)
        rows.append(
            {
                "workload": workload,
                "prefix_caching": caching,
                "cached_prompt_tokens": sum(t.num_cached_tokens for t in timings),
                **{
                    k: summary[k]
                    for k in (
                        "requests",
                        "duration_s",
                        "ttft_ms_mean",
                        "ttft_ms_median",
                        "ttft_ms_p99",
                        "output_tokens_per_s",
                    )
                },
                **stats,
            }
        )
    return rows


def speculative(config: EngineConfig, args) -> list[dict]:
    """Speculative decoding off and on (``cluster.bench.speculative``)."""
    from cluster.bench.speculative import speculative as measure_speculative

    return measure_speculative(config, args)


def decode(config: EngineConfig, args) -> list[dict]:
    """The cost of one decode step at each context length (``cluster.bench.decode_cost``)."""
    return decode_cost(config, args)
