"""Sending benchmark requests through the client and timing what comes back."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from cluster.bench.workload import BenchRequest
from cluster.client import AsyncClient
from cluster.stats import percentile


@dataclass
class RequestTiming:
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    ttft: float = 0.0  # seconds to the first output token
    latency: float = 0.0  # seconds to the last
    token_gaps: list[float] = field(default_factory=list)  # between streamed messages

    @property
    def tpot(self) -> float:
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


async def _timed(client: AsyncClient, request: BenchRequest) -> RequestTiming:
    timing = RequestTiming(num_prompt_tokens=len(request.prompt))
    started = last = time.perf_counter()
    async for delta in client.stream(
        request.prompt, max_tokens=request.max_tokens, temperature=0, ignore_eos=True
    ):
        now = time.perf_counter()
        if delta.token_ids:
            if timing.num_output_tokens == 0:
                timing.ttft = now - started
            else:
                timing.token_gaps.append(now - last)
            timing.num_output_tokens += len(delta.token_ids)
            last = now
        if delta.usage is not None:
            timing.num_cached_tokens = delta.usage.cached_prompt_tokens
    timing.latency = last - started
    return timing


async def run_requests(
    address: str,
    requests: list[BenchRequest],
    *,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
) -> tuple[list[RequestTiming], float]:
    """Send ``requests`` (all at once, or as a Poisson process of ``request_rate`` per
    second; at most ``max_concurrency`` in flight, None: no bound); returns their timings and
    the wall time of the whole run."""
    rng = random.Random(seed)
    in_flight = asyncio.Semaphore(max_concurrency or len(requests) or 1)

    async def bounded(client: AsyncClient, request: BenchRequest) -> RequestTiming:
        async with in_flight:
            return await _timed(client, request)

    async with AsyncClient(address, api_key=api_key) as client:
        started = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(bounded(client, request)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        timings = await asyncio.gather(*tasks)
        return list(timings), time.perf_counter() - started


def latency_summary(timings: list[RequestTiming], wall: float) -> dict:
    ms = 1000.0
    ttft = [t.ttft * ms for t in timings]
    tpot = [t.tpot * ms for t in timings if t.num_output_tokens > 1]
    itl = [gap * ms for t in timings for gap in t.token_gaps]
    row = {
        "requests": len(timings),
        "duration_s": wall,
        "request_throughput": len(timings) / wall if wall else 0.0,
        "output_tokens_per_s": sum(t.num_output_tokens for t in timings) / wall,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        row[f"{name}_mean"] = statistics.fmean(values) if values else 0.0
        row[f"{name}_median"] = statistics.median(values) if values else 0.0
        row[f"{name}_p99"] = percentile(values, 0.99)
    return row
