"""Run prompts through real kvray workers (one process, or one process per TP rank on gloo)."""

from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from kvcore import KVCacheConfig, RankReport, decode, encode, get_kv_cache_config
from workers.bringup import bring_up_in_process
from workers.parallel import pick_rendezvous
from workers.protocol import StepResult
from workers.worker import Worker, WorkerOptions

KV_CACHE_MEMORY = 8 << 20


def tiny_model_options(model_dir, *, backend: str = "torch", tp: int = 1, **extra):
    """A tiny checkpoint's worker: 4-token blocks, an 8 MiB cache, one Mamba state per
    request (these runs plan blocks by hand, without the coordinator's prefix caching)."""
    return WorkerOptions(
        model=str(model_dir),
        tensor_parallel_size=tp,
        block_size=4,
        attention_backend=backend,
        kv_cache_memory_bytes=KV_CACHE_MEMORY,
        **{"enable_prefix_caching": False, **extra},
    )


def prompt_batches(prompts, num_tokens: int):
    """One batch of every prompt at once, request ids r0, r1, ..."""
    return [[(f"r{i}", p, num_tokens, None) for i, p in enumerate(prompts)]]


def plan_of(report: RankReport, layout: str, max_model_len: int = 256) -> KVCacheConfig:
    """A rank's cache plan from its own report, in ``layout``."""
    return get_kv_cache_config(
        report.specs,
        report.free_memory_bytes,
        layout,
        max_model_len=max_model_len,
        max_num_batched_tokens=256,
    )


def plan_for(worker: Worker, layout: str, max_model_len: int = 256) -> KVCacheConfig:
    return plan_of(decode(worker.report_specs(), RankReport), layout, max_model_len)


def start_worker(
    options: WorkerOptions, layout: str, *, rank: int = 0, init_method: str | None = None
) -> Worker:
    """A worker brought up as every engine brings its ranks up, planned from its own report."""
    worker = Worker(rank, options)
    bring_up_in_process(worker, lambda reports: plan_of(reports[0], layout), init_method)
    return worker


def run_requests(worker: Worker, batches, *, chunk: int):
    """``batches``: lists of (request id, prompt, max tokens, prefix_of), run one after the
    other on a started worker. ``prefix_of`` names an earlier request whose first blocks this
    one reuses."""
    from tests.workers.harness import StepDriver

    config = worker.runner.config
    driver = StepDriver(config, lambda plan: decode(worker.execute(encode(plan)), StepResult))
    outputs = {}
    for batch in batches:
        hits = {}
        for request_id, prompt, _, prefix_of in batch:
            if prefix_of is not None:
                hits[request_id] = driver.prefix_hit(prefix_of, prompt)
        requests = [(rid, prompt, n) for rid, prompt, n, _ in batch]
        outputs |= driver.generate(requests, chunk=chunk, prefix_from=hits)
    return outputs


def run_in_process(options: WorkerOptions, layout: str, batches, *, chunk: int):
    return run_requests(start_worker(options, layout), batches, chunk=chunk)


def _rank_main(rank, address, options, layout, batches, chunk, probe):
    worker = start_worker(options, layout, rank=rank, init_method=address)
    outputs = run_requests(worker, batches, chunk=chunk)
    probed = None if probe is None else probe(worker)
    worker.shutdown()
    return outputs, probed


def _reporting(target, rank, address, args, queue):
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        queue.put((rank, target(rank, address, *args), None))
    except BaseException:  # report it to the parent instead of hanging it
        queue.put((rank, None, traceback.format_exc()))


def run_in_processes(target, num_ranks: int, *args, timeout: float = 600) -> dict:
    """``target(rank, address, *args)`` (a module-level function) in a spawned process per
    rank, all given one rendezvous ``address``; rank -> what each returned. A rank that
    raises fails the call with its traceback; none is left running."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    address = pick_rendezvous()
    processes = [
        context.Process(target=_reporting, args=(target, rank, address, args, queue))
        for rank in range(num_ranks)
    ]
    for process in processes:
        process.start()
    results = {}
    try:
        for _ in processes:
            rank, result, error = queue.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = result
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return results


def run_tensor_parallel(
    options: WorkerOptions, layout: str, batches, *, chunk: int, timeout: float = 600, probe=None
):
    """Every rank in its own process; returns rank 0's outputs after checking all agree.
    With ``probe`` (a module-level function of the finished worker), returns the outputs and
    every rank's probe result."""
    results = run_in_processes(
        _rank_main, options.tensor_parallel_size, options, layout, batches, chunk, probe,
        timeout=timeout,
    )  # fmt: skip
    assert all(outputs == results[0][0] for outputs, _ in results.values()), "ranks disagree"
    if probe is None:
        return results[0][0]
    return results[0][0], [results[rank][1] for rank in sorted(results)]
