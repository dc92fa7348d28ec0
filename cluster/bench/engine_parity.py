"""In-process engines one after another (torch attention, Triton, then Triton with
``--enforce-eager``), no Ray: the same greedy tokens from each, each one's memory budget line,
the compile stall a fresh Triton cache costs, and one stream's decode step with CUDA graphs
and without. Part of ``python -m cluster.bench.gpu_check``.

    python -m cluster.bench.engine_parity              # on a GPU: embedded:20m in bfloat16
    python -m cluster.bench.engine_parity --smoke      # CPU-sized: embedded:tiny, interpreter

The stall is the first batch's time less a second batch's of the same shape (other tokens, so
no prefix hit): what a fresh pod's first users wait while kernels compile. Starting the second
engine in the process that ran the first is itself a check: its memory check must count what
the first left cached as free. The decode step is one request's time per output token past
the first (the difference of a 1-token and a long generation of the same prompt length),
where a small model's step is the host launching kernels, which the graphs replace. The last
line is the part's one-line summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

# A fresh cache, chosen before triton is imported, so the stall measured is a fresh pod's.
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kvray-triton-"))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cluster.client import Client
from cluster.config import EngineConfig
from cluster.local import LocalServer


@dataclass
class EngineRun:
    tokens: list[list[int]]
    start_s: float
    first_batch_s: float
    repeat_batch_s: float
    decode_step_ms: float  # one stream's time per output token past the first
    budget: str  # the worker's memory budget line, or why there is none
    graphs: str  # the worker's capture line, or "none"


class WorkerLines(logging.Handler):
    """Keeps the worker's memory profile line and its decode-graph capture line."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.budget = "none: the KV cache size is given on CPUs"
        self.graphs = "none"

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "memory profile" in message:
            self.budget = message.split("; ", 1)[-1]
        elif "decode graphs" in message:
            self.graphs = message


def prompts(seed: int, num: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(8 + 5 * i)] for i in range(num)]


def batch(client: Client, batch_prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    tokens = [
        client.generate(p, max_tokens=max_tokens, temperature=0).token_ids for p in batch_prompts
    ]
    return tokens, time.perf_counter() - started


def decode_step_ms(client: Client, vocab_size: int, num_steps: int) -> float:
    """One stream's decode step: a ``num_steps + 1``-token generation less a 1-token one,
    over ``num_steps`` (other prompts of one length: no prefix hit)."""
    (short,), (long,) = prompts(2, 1, vocab_size), prompts(3, 1, vocab_size)
    _, one_s = batch(client, [short], 1)
    _, many_s = batch(client, [long], num_steps + 1)
    return 1000 * (many_s - one_s) / num_steps


def run_engine(
    config: EngineConfig, num_prompts: int, max_tokens: int, vocab_size: int, decode_steps: int
) -> EngineRun:
    handler = WorkerLines()
    loggers = [logging.getLogger(name) for name in ("workers.worker", "workers.cuda_graphs")]
    for logger in loggers:
        logger.addHandler(handler)
    started = time.perf_counter()
    try:
        with LocalServer(config) as server, Client(server.address, timeout=600) as client:
            start_s = time.perf_counter() - started
            tokens, first_s = batch(client, prompts(0, num_prompts, vocab_size), max_tokens)
            _, repeat_s = batch(client, prompts(1, num_prompts, vocab_size), max_tokens)
            step_ms = decode_step_ms(client, vocab_size, decode_steps)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    return EngineRun(tokens, start_s, first_s, repeat_s, step_ms, handler.budget, handler.graphs)


def common_prefix(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="embedded:tiny, float32 (CI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for name in ("workers.worker", "workers.cuda_graphs"):
        logging.getLogger(name).setLevel(logging.INFO)
    model, dtype = ("embedded:tiny", "float32") if args.smoke else ("embedded:20m", "bfloat16")
    num_prompts, max_tokens = (2, 6) if args.smoke else (8, 32)
    decode_steps = 4 if args.smoke else 64
    settings = dict(model=model, dtype=dtype, port=0, max_model_len=512, max_num_seqs=16,
                    gpu_memory_utilization=0.3, kv_cache_memory_bytes=16 << 20)  # fmt: skip
    runs = []
    engines = (("torch", False), ("triton", False), ("triton", True))
    for backend, eager in engines:
        config = EngineConfig(attention_backend=backend, enforce_eager=eager, **settings)
        run = run_engine(config, num_prompts, max_tokens, 256, decode_steps)
        print(f"{backend}{' --enforce-eager' if eager else ''}: started in {run.start_s:.1f} s, "
              f"first batch {run.first_batch_s:.2f} s, same shapes again "
              f"{run.repeat_batch_s:.2f} s, decode step {run.decode_step_ms:.2f} ms; memory: "
              f"{run.budget}; graphs: {run.graphs}", flush=True)  # fmt: skip
        runs.append(run)
    torch_run, triton_run, eager_run = runs
    pairs = list(zip(torch_run.tokens, triton_run.tokens, strict=True))
    prefixes = [common_prefix(a, b) for a, b in pairs]
    identical = sum(a == b for a, b in pairs)
    # float32 must agree exactly; in bf16 the two backends round differently, so random
    # weights may part at a near-tie late on, but never at the first token.
    agree = identical == len(prefixes) if dtype == "float32" else min(prefixes) > 0
    # Graphs replay the eager step's kernels, but a padded batch may take other matmul
    # algorithms: the first tokens must agree.
    graph_prefixes = [
        common_prefix(a, b) for a, b in zip(triton_run.tokens, eager_run.tokens, strict=True)
    ]
    agree = agree and min(graph_prefixes) > 0
    stall = triton_run.first_batch_s - triton_run.repeat_batch_s
    graphs = (
        f"decode step {triton_run.decode_step_ms:.2f} ms with CUDA graphs, "
        f"{eager_run.decode_step_ms:.2f} ms eager"
        if triton_run.graphs != "none"
        else f"decode step {eager_run.decode_step_ms:.2f} ms eager (no CUDA graphs here)"
    )
    print(f"summary: {model} {dtype}: torch vs triton {identical}/{len(prefixes)} sequences "
          f"identical (common prefixes {prefixes} of {max_tokens}); triton compile stall "
          f"{stall:.2f} s on a fresh cache; {graphs}, graph vs eager common prefixes "
          f"{graph_prefixes}; second engine started in one process")  # fmt: skip
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
