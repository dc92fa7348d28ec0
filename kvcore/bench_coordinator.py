"""Coordinator benchmark: ``python -m kvcore.bench_coordinator [--quick]``.

Prints one table with three parts:

a. coordinator time per engine step: one decode token for each of 256 running requests
   (allocate + cache_blocks) in a 3-group model (full + sliding window + Mamba "align");
b. longest-hit search for a 32k-token prompt, fully and half cached, in a full-only model and
   in the 3-group model;
c. allocate + free per block, in pools of 1k, 10k and 100k blocks, half of each held by
   other requests: flat figures show the cost is O(1) per block.

``--quick`` shrinks the step and repeat counts to a few-second smoke run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from kvcore.attention_specs import FullAttentionSpec, SlidingWindowSpec
from kvcore.coordinator import KVCacheCoordinator
from kvcore.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvcore.kv_request import KVRequest
from kvcore.mamba_spec import MambaSpec

BLOCK_SIZE = 16
FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16")
SWA = SlidingWindowSpec(
    block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=512
)
MAMBA = MambaSpec(
    block_size=BLOCK_SIZE, shapes=((64, 128),), dtypes=("bfloat16",), mamba_cache_mode="align"
)


def make_config(specs: Sequence, num_blocks: int, max_model_len: int) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=spec)
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        layout="LBNHC",
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        cache_hit_alignment=BLOCK_SIZE,
        max_model_len=max_model_len,
    )


def make_coordinator(specs: Sequence, num_blocks: int, max_model_len: int = 65_536):
    config = make_config(specs, num_blocks, max_model_len)
    return KVCacheCoordinator.from_config(config, max_num_batched_tokens=8192)


def prefill(coordinator, request: KVRequest, chunk: int = 2048) -> None:
    """Compute the whole prompt in block-aligned chunks, caching as the engine would."""
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if coordinator.allocate(request, num_new) is None:
            raise RuntimeError("the benchmark pool is too small")
        request.num_computed_tokens += num_new
        coordinator.cache_blocks(request, request.num_computed_tokens)


def bench_decode_step(num_requests: int, num_steps: int) -> list[float]:
    """Milliseconds per engine step, one sample per step."""
    rng = random.Random(0)
    coordinator = make_coordinator([FULL, SWA, MAMBA], num_blocks=60_000)
    requests = []
    for index in range(num_requests):
        prompt = [rng.randrange(32_000) for _ in range(rng.randrange(256, 1024))]
        request = KVRequest(f"r{index}", prompt, hash_block_size=BLOCK_SIZE)
        prefill(coordinator, request)
        request.append_token_ids([rng.randrange(32_000)])
        requests.append(request)
    samples = []
    for _ in range(num_steps):
        start = time.perf_counter_ns()
        for request in requests:
            if coordinator.allocate(request, 1) is None:
                raise RuntimeError("the benchmark pool is too small")
        for request in requests:
            request.num_computed_tokens += 1
            coordinator.cache_blocks(request, request.num_computed_tokens)
        samples.append((time.perf_counter_ns() - start) / 1e6)
        for request in requests:  # sampling: the scheduler's work, not timed
            request.append_token_ids([7])
    return samples


def bench_longest_hit(specs: Sequence, cached_fraction: float, repeats: int) -> tuple[float, int]:
    """Median milliseconds of find_longest_cache_hit for a 32k-token prompt, and the hit."""
    num_tokens = 32_768
    rng = random.Random(1)
    prompt = [rng.randrange(32_000) for _ in range(num_tokens)]
    coordinator = make_coordinator(specs, num_blocks=12_000)
    seed = KVRequest("seed", prompt[: int(num_tokens * cached_fraction)], hash_block_size=16)
    prefill(coordinator, seed)
    coordinator.free(seed)
    probe = KVRequest("probe", prompt, hash_block_size=BLOCK_SIZE)
    assert probe.block_hashes  # hashing happens as tokens arrive, not in the search
    num_hit_tokens = coordinator.find_longest_cache_hit(probe).num_tokens
    return _median_ms(lambda: coordinator.find_longest_cache_hit(probe), repeats), num_hit_tokens


def bench_allocate_free(num_blocks: int, repeats: int) -> float:
    """Nanoseconds per block of allocate + free for 64-block requests, pool half in use."""
    coordinator = make_coordinator([FULL], num_blocks=num_blocks)
    tokens_per_request = 64 * BLOCK_SIZE
    for index in range((num_blocks // 2) // 64):
        holder = KVRequest(f"h{index}", [index] * tokens_per_request, hash_block_size=16)
        coordinator.allocate(holder, tokens_per_request)
    request = KVRequest("probe", list(range(tokens_per_request)), hash_block_size=16)

    def allocate_and_free() -> None:
        coordinator.allocate(request, tokens_per_request)
        coordinator.free(request)

    return _median_ms(allocate_and_free, repeats) * 1e6 / 64


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(samples)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    args = parser.parse_args(argv)
    num_steps, repeats = (10, 5) if args.quick else (300, 50)
    rows: list[tuple[str, str]] = []
    steps = sorted(bench_decode_step(256, num_steps))
    p99 = steps[min(len(steps) - 1, int(len(steps) * 0.99))]
    median = statistics.median(steps)
    rows.append(("a. decode step, 256 reqs, 3 groups: median", f"{median:.3f} ms"))
    rows.append(("a. decode step, 256 reqs, 3 groups: p99", f"{p99:.3f} ms"))
    for label, specs in (("full only", [FULL]), ("3 groups", [FULL, SWA, MAMBA])):
        for fraction, state in ((1.0, "fully"), (0.5, "half")):
            median, num_hit_tokens = bench_longest_hit(specs, fraction, repeats)
            label_b = f"b. longest hit, 32k prompt, {label}, {state} cached"
            rows.append((label_b, f"{median:.3f} ms (hit {num_hit_tokens} tokens)"))
    for num_blocks in (1_000, 10_000, 100_000):
        per_block = bench_allocate_free(num_blocks, repeats * 4)
        rows.append((f"c. allocate+free per block, {num_blocks} blocks", f"{per_block:.0f} ns"))
    width = max(len(label) for label, _ in rows)
    print(f"{'measurement':<{width}}  value")
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
