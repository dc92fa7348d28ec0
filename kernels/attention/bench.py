"""Benchmark of the Triton paged attention in every KV-cache layout. Not a test.

Decode: achieved bandwidth (bytes of K/V read plus Q read and O written, over the kernel time)
against a measured device-to-device copy bandwidth, for every layout x batch x context x block
size. Prefill: TFLOP/s of one causal request against ``scaled_dot_product_attention`` on
contiguous tensors of the same shape.

    python -m kernels.attention.bench                      # on a GPU, the full sweep
    python -m kernels.attention.bench --device cpu --small # CI-sized, Triton interpreter

Results are checked against the torch reference: all of them on the CPU, and on a GPU the
shapes whose reference fits comfortably in memory.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

import kvcore
from kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from kernels.attention.params import AttentionParams


@dataclass(frozen=True)
class Sweep:
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    block_sizes: tuple[int, ...]
    dtype: torch.dtype


FULL = Sweep(32, 8, 128, (1, 16, 64, 256), (1024, 4096, 16384), (1024, 4096, 16384), (16, 64),
             torch.bfloat16)  # fmt: skip
SMALL = Sweep(4, 2, 32, (2,), (24, 80), (72,), (16, 64), torch.float32)
# On a GPU, results up to these sizes are checked against the torch reference too.
CHECKED_DECODE_TOKENS, CHECKED_PREFILL_LEN = 16 * 4096, 1024
NUM_LAYERS = 2  # so that layer-inner layouts (BLHNC, BLNHC, BHLNC) really interleave layers


def time_ms(fn, device: str, num_reps: int) -> float:
    """Milliseconds per call: triton's do_bench on a GPU, a plain loop on a CPU (the callers
    have already run ``fn`` once, which is the warm-up)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100)
    start = time.perf_counter()
    for _ in range(num_reps):
        fn()
    return (time.perf_counter() - start) * 1e3 / num_reps


def copy_bandwidth_gbs(device: str, num_bytes: int, num_reps: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, num_reps)
    return 2 * num_bytes / ms / 1e6  # read + write


def make_layer_cache(layout: str, sweep: Sweep, block_size: int, num_blocks: int, device: str):
    dtype_name = str(sweep.dtype).removeprefix("torch.")
    spec = kvcore.FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=sweep.num_kv_heads,
        head_size=sweep.head_size,
        dtype=dtype_name,
    )
    names = [f"layer.{i}" for i in range(NUM_LAYERS)]
    tensor = kvcore.build_kv_cache_tensor(spec, names, num_blocks, layout)
    raw = torch.empty(tensor.size, dtype=torch.int8, device=device)
    view = kvcore.create_kv_cache_views(raw, spec, num_blocks, layout, tensor)[names[-1]]
    view.uniform_(-1.0, 1.0)  # only the benchmarked layer; the other is never read
    return view


def make_step(sweep: Sweep, query_len: int, seq_len: int, batch: int, block_size: int, device):
    """Metadata and query for ``batch`` requests, over shuffled blocks of one cache."""
    blocks_per_req = -(-seq_len // block_size)
    block_ids = torch.randperm(batch * blocks_per_req).view(batch, blocks_per_req).tolist()
    metadata = build_attention_metadata(
        [query_len] * batch, [seq_len] * batch, block_ids, block_size, device
    )
    query = torch.randn(
        (batch * query_len, sweep.num_q_heads, sweep.head_size), dtype=sweep.dtype, device=device
    )
    return metadata, query, batch * blocks_per_req


def check_against_reference(query, view, metadata: AttentionMetadata, params, out) -> None:
    from kernels.attention.reference import paged_attention_reference

    expected = paged_attention_reference(query, view, metadata, params)
    error = float((out.double() - expected.double()).abs().max() / expected.abs().max())
    bound = 1e-3 if query.dtype == torch.float32 else 2e-2
    if not error <= bound:
        raise AssertionError(f"Triton output differs from the torch reference by {error:.3g}.")


def bench_decode(sweep, layout, block_size, batch, context_len, device, num_reps, is_checked):
    from kernels.attention.paged_attention import paged_attention

    metadata, query, num_blocks = make_step(sweep, 1, context_len, batch, block_size, device)
    view = make_layer_cache(layout, sweep, block_size, num_blocks, device)
    params = AttentionParams(scale=sweep.head_size**-0.5, num_kv_heads=sweep.num_kv_heads)
    out = paged_attention(query, view, metadata, params)
    if is_checked or batch * context_len <= CHECKED_DECODE_TOKENS:
        check_against_reference(query, view, metadata, params, out)
    ms = time_ms(lambda: paged_attention(query, view, metadata, params, out), device, num_reps)
    itemsize = sweep.dtype.itemsize
    kv_bytes = batch * context_len * sweep.num_kv_heads * 2 * sweep.head_size * itemsize
    num_bytes = kv_bytes + 2 * query.numel() * itemsize  # + Q read + O written
    return ms, num_bytes / ms / 1e6


def bench_prefill(sweep, layout, block_size, seq_len, device, num_reps, is_checked):
    from kernels.attention.paged_attention import paged_attention

    metadata, query, num_blocks = make_step(sweep, seq_len, seq_len, 1, block_size, device)
    view = make_layer_cache(layout, sweep, block_size, num_blocks, device)
    params = AttentionParams(scale=sweep.head_size**-0.5, num_kv_heads=sweep.num_kv_heads)
    out = paged_attention(query, view, metadata, params)
    if is_checked or seq_len <= CHECKED_PREFILL_LEN:
        check_against_reference(query, view, metadata, params, out)
    ms = time_ms(lambda: paged_attention(query, view, metadata, params, out), device, num_reps)
    return ms, causal_flops(sweep, seq_len) / ms / 1e9


def bench_sdpa(sweep, seq_len, device, num_reps) -> float:
    """TFLOP/s of SDPA on contiguous [1, Hq, S, D] tensors (K/V heads repeated up front)."""
    shape = (1, sweep.num_q_heads, seq_len, sweep.head_size)
    q, k, v = (torch.randn(shape, dtype=sweep.dtype, device=device) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = time_ms(lambda: sdpa(q, k, v, is_causal=True), device, num_reps)
    return causal_flops(sweep, seq_len) / ms / 1e9


def causal_flops(sweep: Sweep, seq_len: int) -> float:
    # Two matmuls (QK^T, PV) of 2*D flops per visible (query, key) pair, per query head.
    num_pairs = seq_len * (seq_len + 1) / 2
    return 4 * sweep.head_size * sweep.num_q_heads * num_pairs


def run_decode(sweep, device, num_reps, is_checked, copy_gbs) -> None:
    print(f"\n# decode: achieved GB/s and share of copy bandwidth ({copy_gbs:.1f} GB/s)")
    print(f"{'block':>5} {'batch':>5} {'context':>7}  layout   ms        GB/s   of copy")
    for block_size in sweep.block_sizes:
        for batch in sweep.batch_sizes:
            for context_len in sweep.context_lens:
                rates = {}
                for layout in kvcore.valid_layout_names():
                    ms, gbs = bench_decode(
                        sweep, layout, block_size, batch, context_len, device, num_reps, is_checked
                    )
                    rates[layout] = gbs
                    print(f"{block_size:>5} {batch:>5} {context_len:>7}  {layout}  "
                          f"{ms:9.3f} {gbs:9.3g} {gbs / copy_gbs:8.1%}")  # fmt: skip
                slowest = min(rates.values()) / max(rates.values())
                print(f"{'':>20}  worst layout at {slowest:.1%} of the best")


def run_prefill(sweep, device, num_reps, is_checked) -> None:
    print("\n# prefill: one causal request, TFLOP/s vs SDPA on contiguous tensors")
    print(f"{'block':>5} {'seq':>7}  layout   ms        TFLOP/s  vs SDPA")
    for seq_len in sweep.prefill_lens:
        sdpa_tflops = bench_sdpa(sweep, seq_len, device, num_reps)
        print(f"{'':>5} {seq_len:>7}  SDPA     {'':9} {sdpa_tflops:9.3g}")
        for block_size in sweep.block_sizes:
            for layout in kvcore.valid_layout_names():
                ms, tflops = bench_prefill(
                    sweep, layout, block_size, seq_len, device, num_reps, is_checked
                )
                print(f"{block_size:>5} {seq_len:>7}  {layout}  {ms:9.3f} {tflops:9.3g} "
                      f"{tflops / sdpa_tflops:7.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--small", action="store_true", help="CI-sized shapes")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # Must precede the first import of triton, which the bench functions do lazily.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sweep = SMALL if args.small or device == "cpu" else FULL
    is_checked = device == "cpu"
    num_reps = 1 if device == "cpu" else 0
    torch.manual_seed(0)
    copy_bytes = 1 << 30 if device == "cuda" else 1 << 24
    copy_gbs = copy_bandwidth_gbs(device, copy_bytes, max(num_reps, 3))
    run_decode(sweep, device, num_reps, is_checked, copy_gbs)
    run_prefill(sweep, device, num_reps, is_checked)
    print(f"\ndone on {device}")


if __name__ == "__main__":
    main()
