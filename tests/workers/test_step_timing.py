"""Each reply of a worker says how long its step took and how long the worker sat idle before
taking it: the engine's step overhead for steps sent ahead is rank 0's own account of the time
between its replies (``AsyncEngine._step_wall``)."""

from __future__ import annotations

import time

from kvcore import decode, encode
from tests.workers.engine import KV_CACHE_MEMORY, start_worker
from tests.workers.harness import StepDriver
from workers.protocol import StepResult
from workers.worker import WorkerOptions

LATE_S = 0.05  # how long the stand-in controller holds each plan after the first


def test_a_reply_times_its_step_and_the_wait_before_it():
    options = WorkerOptions(
        model="embedded:tiny", block_size=4, kv_cache_memory_bytes=KV_CACHE_MEMORY,
        enable_prefix_caching=False,
    )  # fmt: skip
    worker = start_worker(options, "LBHNC")
    timed = []

    def execute(plan):
        if timed:
            time.sleep(LATE_S)  # the next plan reaches the worker late
        started = time.perf_counter()
        result = decode(worker.execute(encode(plan)), StepResult)
        timed.append((result, time.perf_counter() - started))
        return result

    try:
        StepDriver(worker.runner.config, execute).generate([("r0", [5, 6, 7, 8, 9], 4)], chunk=8)
    finally:
        worker.shutdown()
    assert len(timed) >= 4
    assert timed[0][0].waited_seconds == 0.0  # nothing answered before the first step
    for result, seen in timed:
        assert result.forward_seconds <= result.step_seconds <= seen
        assert result.forward_seconds > 0.0 or not result.sampled  # a step that ran a forward
    for result, _ in timed[1:]:
        assert LATE_S <= result.waited_seconds < LATE_S + 0.5
