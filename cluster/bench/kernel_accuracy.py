"""The Triton attention and cache-write kernels against their references, in every layout and
dtype, with the largest relative error of each. Part of ``python -m cluster.bench.gpu_check``.

    python -m cluster.bench.kernel_accuracy            # on a GPU: compiled kernels, head 128
    python -m cluster.bench.kernel_accuracy --smoke    # CPU-sized: the Triton interpreter

Attention is checked against the dense float64 oracle over prefill, decode and mixed batches,
with and without a sliding window; the cache write must store exactly what the torch writer
stores. On CPUs the interpreter computes bf16 and fp16 in fp32, so only a GPU run says how the
kernels' half-precision maths behaves. The last line is the part's one-line summary.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import zlib

import torch

# The interpreter has to be chosen before the kernels' module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcore
from kernels.attention.cache_write import write_kv
from kernels.attention.params import AttentionParams
from kernels.attention.reference import write_kv_reference
from tests.kernels.cases import (
    BATCHES,
    WINDOW,
    blocks_needed,
    dense_outputs,
    make_batch,
    make_cache,
    poisoned,
    randn,
    relative_error,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The largest relative error each dtype may show against float64: a few units of its rounding.
BOUNDS = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


def attention_error(layout: str, dtype_name: str, head_size: int) -> float:
    """Max relative error of paged attention (GQA 4 -> 1 head groups) over every batch kind."""
    from kernels.attention.paged_attention import paged_attention

    num_q_heads, num_kv_heads = 8, 2
    spec = kvcore.FullAttentionSpec(
        block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype_name
    )
    cache = make_cache(layout, spec, max(blocks_needed(b, 16) for b in BATCHES.values()) + 2)
    cache.raw.fill_(0x7F)  # unwritten cells read as huge numbers
    generator = torch.Generator().manual_seed(zlib.crc32(f"{layout}{dtype_name}".encode()))
    worst = 0.0
    for requests in BATCHES.values():
        batch = make_batch(cache, requests, num_q_heads, generator)
        for window in (None, WINDOW):
            params = AttentionParams(
                scale=1 / math.sqrt(head_size), num_kv_heads=num_kv_heads, sliding_window=window
            )
            shape = (*batch.query.shape[:2], head_size)
            out = poisoned(shape, batch.query.dtype)
            paged_attention(batch.query, cache.view, batch.metadata, params, out=out)
            worst = max(worst, relative_error(out, dense_outputs(batch, params)))
    return worst


def cache_write_matches(layout: str, dtype_name: str, head_size: int) -> bool:
    """The Triton cache write stores bit for bit what the torch writer stores."""
    spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=head_size,
                                    dtype=dtype_name)  # fmt: skip
    ours, theirs = make_cache(layout, spec, 6), make_cache(layout, spec, 6)
    generator = torch.Generator().manual_seed(7)
    dtype = DTYPES[dtype_name]
    key = randn((40, 2, head_size), dtype, generator)
    value = randn((40, 2, head_size), dtype, generator)
    slots = torch.randperm(6 * 16, generator=generator)[:40].to(ours.raw.device)
    slots[3] = -1  # a padded token: written by nobody
    write_kv(key, value, ours.view, slots)
    write_kv_reference(key, value, theirs.view, slots)
    return bool(torch.equal(ours.raw, theirs.raw))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small heads, two layouts (CI)")
    args = parser.parse_args(argv)
    head_size = 16 if args.smoke else 128
    layouts = ["LBHNC", "BHLNC"] if args.smoke else kvcore.valid_layout_names()
    failures, summary = [], []
    for dtype_name, bound in BOUNDS.items():
        errors = {layout: attention_error(layout, dtype_name, head_size) for layout in layouts}
        writes = [layout for layout in layouts if not cache_write_matches(layout, dtype_name,
                                                                          head_size)]  # fmt: skip
        worst = max(errors, key=errors.get)
        print(f"{dtype_name}: attention max relative error {errors[worst]:.2e} ({worst}), "
              f"bound {bound:.0e}; cache write exact in {len(layouts) - len(writes)}/"
              f"{len(layouts)} layouts", flush=True)  # fmt: skip
        failures += [f"{dtype_name} attention in {lay}" for lay, e in errors.items() if e > bound]
        failures += [f"{dtype_name} cache write in {layout}" for layout in writes]
        summary.append(f"{dtype_name} {errors[worst]:.1e}")
    return print_summary("attention", summary, f"{len(layouts)} layouts, head {head_size}",
                         failures)  # fmt: skip


def print_summary(what: str, per_dtype: list[str], over: str, failures: list[str]) -> int:
    """The part's one-line summary, printed last; returns the exit status (1: a bound missed)."""
    verdict = f"failed: {', '.join(failures)}" if failures else "within bounds"
    print(f"summary: {what} max rel. error {'; '.join(per_dtype)} over {over}; {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
