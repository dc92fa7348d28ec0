"""Two in-process engines one after another (torch attention, then Triton), no Ray: the same
greedy tokens from both, each one's memory budget line, and the compile stall a fresh Triton
cache costs. Part of ``python -m cluster.bench.gpu_check``.

    python -m cluster.bench.engine_parity              # on a GPU: embedded:20m in bfloat16
    python -m cluster.bench.engine_parity --smoke      # CPU-sized: embedded:tiny, interpreter

The stall is the first batch's time less a second batch's of the same shape (other tokens, so
no prefix hit): what a fresh pod's first users wait while kernels compile. Starting the second
engine in the process that ran the first is itself a check: its memory check must count what
the first left cached as free. The last line is the part's one-line summary.
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
    budget: str  # the worker's memory budget line, or why there is none


class BudgetLine(logging.Handler):
    """Keeps the worker's memory profile line."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.line = "none: the KV cache size is given on CPUs"

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "memory profile" in message:
            self.line = message.split("; ", 1)[-1]


def prompts(seed: int, num: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(8 + 5 * i)] for i in range(num)]


def batch(client: Client, batch_prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    tokens = [
        client.generate(p, max_tokens=max_tokens, temperature=0).token_ids for p in batch_prompts
    ]
    return tokens, time.perf_counter() - started


def run_engine(
    config: EngineConfig, num_prompts: int, max_tokens: int, vocab_size: int
) -> EngineRun:
    handler = BudgetLine()
    logging.getLogger("workers.worker").addHandler(handler)
    started = time.perf_counter()
    try:
        with LocalServer(config) as server, Client(server.address, timeout=600) as client:
            start_s = time.perf_counter() - started
            tokens, first_s = batch(client, prompts(0, num_prompts, vocab_size), max_tokens)
            _, repeat_s = batch(client, prompts(1, num_prompts, vocab_size), max_tokens)
    finally:
        logging.getLogger("workers.worker").removeHandler(handler)
    return EngineRun(tokens, start_s, first_s, repeat_s, handler.line)


def common_prefix(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="embedded:tiny, float32 (CI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("workers.worker").setLevel(logging.INFO)
    model, dtype = ("embedded:tiny", "float32") if args.smoke else ("embedded:20m", "bfloat16")
    num_prompts, max_tokens = (2, 6) if args.smoke else (8, 32)
    settings = dict(model=model, dtype=dtype, port=0, max_model_len=512, max_num_seqs=16,
                    gpu_memory_utilization=0.3, kv_cache_memory_bytes=16 << 20)  # fmt: skip
    runs = []
    for backend in ("torch", "triton"):
        config = EngineConfig(attention_backend=backend, **settings)
        run = run_engine(config, num_prompts, max_tokens, 256)
        print(f"{backend}: started in {run.start_s:.1f} s, first batch {run.first_batch_s:.2f} s,"
              f" same shapes again {run.repeat_batch_s:.2f} s; memory: {run.budget}",
              flush=True)  # fmt: skip
        runs.append(run)
    torch_run, triton_run = runs
    pairs = list(zip(torch_run.tokens, triton_run.tokens, strict=True))
    prefixes = [common_prefix(a, b) for a, b in pairs]
    identical = sum(a == b for a, b in pairs)
    # float32 must agree exactly; in bf16 the two backends round differently, so random
    # weights may part at a near-tie late on, but never at the first token.
    agree = identical == len(prefixes) if dtype == "float32" else min(prefixes) > 0
    stall = triton_run.first_batch_s - triton_run.repeat_batch_s
    print(f"summary: {model} {dtype}: torch vs triton {identical}/{len(prefixes)} sequences "
          f"identical (common prefixes {prefixes} of {max_tokens}); triton compile stall "
          f"{stall:.2f} s on a fresh cache; second engine started in one process")  # fmt: skip
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
