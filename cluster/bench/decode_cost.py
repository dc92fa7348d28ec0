"""``kvray bench decode``: what one decode step costs as the context grows.

For each context length, ``--batch-size`` requests whose prompts are that many random tokens
are prefilled, then every step that decodes all of them at once (one token each, nothing else
in the step) is timed. The parts are the engine's own: its scheduler and KV-cache
coordinator, and one worker (TP 1) in this process, stepped here without the server around
them. A step is the scheduler's plan, the worker's execute (batch and metadata, forward,
sampling) and applying its tokens; ``forward`` is the model call alone.

Attention reads every context token at each step; a Mamba layer reads one state of fixed
size, so a hybrid's step grows only by its attention layers' share.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import torch

from cluster.admission import Admission
from cluster.assembly import build_scheduler
from cluster.bench.workload import random_requests
from cluster.config import EngineConfig
from cluster.scheduler.request import EngineRequest
from cluster.scheduler.scheduler import ScheduledStep, Scheduler
from cluster.startup import plan_kv_cache
from cluster.stats import percentile
from kvcore import KVCacheConfig, decode, encode
from workers.bringup import bring_up_in_process
from workers.model_config import ModelConfig
from workers.model_source import load_tokenizer_for, model_display_name
from workers.models.registry import model_class_for
from workers.protocol import StepResult
from workers.worker import Worker


@dataclass
class EngineParts:
    """What a decode run steps: one worker with its cache, and the scheduler over it."""

    worker: Worker
    kv_config: KVCacheConfig
    scheduler: Scheduler
    admission: Admission


@dataclass
class DecodeStep:
    seconds: float  # schedule, execute, apply
    forward_seconds: float  # the model call
    mean_context_len: float  # tokens each request attends to, its new one included


def decode_cost(config: EngineConfig, args) -> list[dict]:
    if config.tensor_parallel_size != 1:
        raise ValueError("bench decode steps one in-process worker: use --tensor-parallel-size 1")
    if args.batch_size < 1 or args.output_len < 1 or args.warmup_steps < 0:
        raise ValueError("--batch-size and --output-len must be at least 1, --warmup-steps 0")
    if args.batch_size > config.max_num_seqs:
        raise ValueError(f"--batch-size {args.batch_size} is over --max-num-seqs")
    max_tokens = max_new_tokens(config, args, max(args.context_lens))
    need = max(args.context_lens) + max_tokens
    if config.max_model_len is None:
        config = msgspec.structs.replace(config, max_model_len=need)
    elif config.max_model_len < need:
        raise ValueError(
            f"--max-model-len {config.max_model_len} is too short: the longest context, the "
            f"outputs made while the batch prefills, the warm-up and timed steps need {need} "
            "tokens (leave it unset to fit them)"
        )
    rows = []
    with engine_parts(config) as parts:
        check_capacity(parts.kv_config, args.batch_size)
        fixed = {
            "model": model_display_name(config.model),
            "params_m": num_parameters(parts.worker.model_config) / 1e6,
        }
        for context_len in args.context_lens:
            steps = measure(parts, context_len, max_new_tokens(config, args, context_len), args)
            rows.append(fixed | summary(context_len, args.batch_size, steps))
    first = rows[0]["step_ms_median"]
    for row in rows:
        row["step_vs_first"] = row["step_ms_median"] / first
    return rows


def max_new_tokens(config: EngineConfig, args, context_len: int) -> int:
    """Outputs each request may need: one per step of the batch's prefill (a request that
    finished its prompt decodes while later ones still prefill, each such decode taking a
    token of the step's budget), the warm-up steps and the timed ones."""
    prefill_budget = config.max_num_batched_tokens - args.batch_size
    if prefill_budget <= 0:
        raise ValueError("--max-num-batched-tokens must exceed --batch-size")
    num_prefill_steps = -(-args.batch_size * context_len // prefill_budget)
    return num_prefill_steps + args.warmup_steps + args.output_len + 1


@contextmanager
def engine_parts(config: EngineConfig) -> Iterator[EngineParts]:
    """The pieces ``cluster.local.LocalServer`` starts, without its event loop and server."""
    config = config.for_workers_on(use_gpu=torch.cuda.is_available())
    worker = Worker(0, config.worker_options())
    try:
        kv_config = bring_up_in_process(
            worker, lambda reports: plan_kv_cache(reports, worker.model_config, config)
        )
        model_config = worker.model_config
        tokenizer = load_tokenizer_for(config.model, model_config.eos_token_ids)
        admission = Admission(
            tokenizer, vocab_size=model_config.vocab_size, max_model_len=kv_config.max_model_len
        )
        scheduler = build_scheduler(config, model_config, kv_config)
        yield EngineParts(worker, kv_config, scheduler, admission)
    finally:
        worker.shutdown()


def check_capacity(kv_config: KVCacheConfig, batch_size: int) -> None:
    """A batch the cache cannot hold would be preempted, and its steps would not decode."""
    if kv_config.max_concurrency < batch_size:
        raise ValueError(
            f"The KV cache holds {kv_config.max_concurrency:.2f} requests of "
            f"{kv_config.max_model_len} tokens, fewer than --batch-size {batch_size}: give it "
            "more --kv-cache-memory"
        )


def num_parameters(model_config: ModelConfig) -> int:
    """The model's parameters (this rank's, TP 1: all), counted on a model without storage."""
    with torch.device("meta"):
        model = model_class_for(model_config)(model_config, torch.float32)
    return sum(p.numel() for p in model.parameters())


def measure(parts: EngineParts, context_len: int, max_tokens: int, args) -> list[DecodeStep]:
    """Prefill a batch at ``context_len``, time ``args.output_len`` steps in which every
    request decodes (after ``args.warmup_steps`` of them), then abort the batch."""
    scheduler = parts.scheduler
    requests = admit(parts, context_len, max_tokens, args)
    for request in requests:
        scheduler.add(request)
    num_preemptions = scheduler.num_preemptions
    steps, num_decode_steps = [], 0
    while len(steps) < args.output_len:
        started = time.perf_counter()
        step = scheduler.schedule()
        if step.is_empty:
            raise RuntimeError("The batch finished before its decode steps were timed")
        result = decode(parts.worker.execute(encode(step.plan)), StepResult)
        scheduler.update(step, result)
        seconds = time.perf_counter() - started
        if scheduler.num_preemptions != num_preemptions:
            raise RuntimeError("A request was preempted: give the KV cache more memory")
        if is_all_decoding(step, args.batch_size):
            num_decode_steps += 1
            if num_decode_steps > args.warmup_steps:
                context = statistics.fmean(r.kv.num_computed_tokens for r, _ in step.scheduled)
                steps.append(DecodeStep(seconds, result.forward_seconds, context))
    for request in requests:
        scheduler.abort(request.request_id)
    parts.worker.execute(encode(scheduler.schedule().plan))  # the worker forgets them
    return steps


def admit(parts: EngineParts, context_len: int, max_tokens: int, args) -> list[EngineRequest]:
    admission = parts.admission
    sampling = admission.sampling_params(
        {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    )
    prompts = random_requests(
        args.batch_size,
        (context_len, context_len),
        (max_tokens, max_tokens),
        vocab_size=admission.vocab_size,
        seed=args.seed + context_len,
    )

    async def admit_all():
        return [
            await admission.request(
                p.prompt,
                sampling,
                f"decode-{context_len}-{i}",
                cache_salt=None,
                hash_block_size=parts.scheduler.coordinator.hash_block_size,
            )
            for i, p in enumerate(prompts)
        ]

    return asyncio.run(admit_all())


def is_all_decoding(step: ScheduledStep, batch_size: int) -> bool:
    return len(step.scheduled) == batch_size and all(n == 1 for _, n in step.scheduled)


def summary(context_len: int, batch_size: int, steps: list[DecodeStep]) -> dict:
    ms = [s.seconds * 1000 for s in steps]
    forward_ms = [s.forward_seconds * 1000 for s in steps]
    median = statistics.median(ms)
    return {
        "context_len": context_len,
        "mean_context_len": statistics.fmean(s.mean_context_len for s in steps),
        "batch_size": batch_size,
        "decode_steps": len(steps),
        "step_ms_median": median,
        "step_ms_p90": percentile(ms, 0.9),
        "forward_ms_median": statistics.median(forward_ms),
        "output_tokens_per_s": batch_size / median * 1000,
    }
