"""Shared pieces of the Ray-backed serving tests."""

from __future__ import annotations

import threading
import time

import ray

from cluster.client import Client, UnavailableError
from cluster.config import EngineConfig
from cluster.controller import start_controller

# One CPU per rank, so several engines fit on one test Ray at once.
BASE = dict(
    kv_cache_memory_bytes=8 << 20,
    port=0,
    max_model_len=256,
    max_num_batched_tokens=64,
    cpus_per_worker=1,
)
PROMPTS = ["first prompt", "a second, longer prompt", [7, 8, 9, 10, 11]]


def serve(**overrides):
    """Start a controller; returns (handle, its address)."""
    handle, info = start_controller(EngineConfig(**{**BASE, **overrides}))
    return handle, info["address"]


def greedy_tokens(address: str, max_tokens: int = 16) -> list[list[int]]:
    with Client(address, timeout=120) as client:
        return [client.generate(p, max_tokens=max_tokens, temperature=0).token_ids for p in PROMPTS]


def generate_all(address: str, prompts, max_tokens: int = 16) -> list[list[int]]:
    """Greedy tokens of ``prompts``, all sent at once, each from a thread of its own (they
    batch in the engine)."""
    results: dict[int, list[int]] = {}

    def run(index: int) -> None:
        with Client(address, timeout=120) as client:
            reply = client.generate(prompts[index], max_tokens=max_tokens, temperature=0)
            results[index] = reply.token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return [results.get(i) for i in range(len(prompts))]


def stop(handle) -> None:
    ray.get(handle.stop.remote())
    ray.kill(handle)


def long_stream(address: str) -> tuple[threading.Thread, list[Exception], threading.Event]:
    """A streaming request that would run for 240 tokens, started in a thread: (the thread,
    the UnavailableError it ends with, if any, an event set at its first token)."""
    errors, first_token = [], threading.Event()

    def run():
        try:
            with Client(address, timeout=120) as client:
                for _ in client.stream(
                    "never finishes", max_tokens=240, temperature=0, ignore_eos=True
                ):
                    first_token.set()
        except UnavailableError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors, first_token


def wait_until_serving(address: str, since: float, limit: float = 120) -> None:
    with Client(address, timeout=120) as client:
        while client.health() != "SERVING":
            assert time.monotonic() - since < limit, f"not serving again within {limit:.0f} s"
            time.sleep(0.5)
