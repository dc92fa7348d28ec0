"""What one MoE layer's experts cost by each way of running them, on the same routing.

A Qwen3-MoE layer's experts (``--experts`` of ``--intermediate`` rows over ``--hidden``,
``--top-k`` per token; the defaults are Qwen3-30B-A3B's 128 experts of 768 rows, top 8, at
hidden 2048) run for T tokens whose router logits are random:

- ``per_expert_loop``: transformers' eager experts (``Qwen3MoeExperts``): a one-hot mask of
  every (token, choice), then one matmul pair per expert that got a token;
- ``grouped``: kvray's torch path (``kernels.moe.reference.grouped_experts``): the pairs
  sorted by expert once, then one matmul pair per expert over its contiguous rows;
- ``grouped_packed`` (on a CPU): the same with each expert's weights packed for oneDNN, as a
  CPU worker runs it (``Experts.pack_for_cpu``);
- ``fused`` (on a GPU only): kvray's Triton kernels (``kernels.moe.triton_moe``): the pairs
  sorted on the device, two grouped GEMMs over every expert's row blocks in one launch each.

Each is the median of ``--repeats`` calls after ``--warmup``; ``max_abs_diff`` compares each
with the per-expert loop.

    python -m cluster.bench.moe_layer                    # CPU, fp32: about a minute
    python -m cluster.bench.moe_layer --quick            # smaller experts: seconds
    python -m cluster.bench.moe_layer --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from cluster.bench.report import format_table, write_json
from kernels.moe.reference import grouped_experts, select_experts
from workers.layers.cpu_matmul import linear, pack_weight


def _per_expert_loop(config, w13, w2):
    """transformers' own experts module holding the same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    moe_config = Qwen3MoeConfig(**config)
    moe_config._experts_implementation = "eager"  # the loop, whatever the default
    experts = Qwen3MoeExperts(moe_config).to(w13.device, w13.dtype)
    experts.gate_up_proj.data = w13
    experts.down_proj.data = w2
    return experts


def _time(call, warmup: int, repeats: int, device: torch.device) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(args) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    experts, inter, hidden, top_k = args.experts, args.intermediate, args.hidden, args.top_k
    w13 = (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter) * inter**-0.5).to(device, dtype)
    loop = _per_expert_loop(
        dict(num_experts=experts, moe_intermediate_size=inter, hidden_size=hidden), w13, w2
    )
    # What a CPU worker runs: each expert's weights packed for oneDNN (None: no oneDNN here).
    packed = {"w13": [pack_weight(w) for w in w13], "w2": [pack_weight(w) for w in w2]}
    if any(p is None for weights in packed.values() for p in weights):
        packed = None
    rows = []
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, hidden).to(device, dtype)
        weights, ids = select_experts(torch.randn(num_tokens, experts).to(device), top_k,
                                      renormalize=True)  # fmt: skip
        weights = weights.to(dtype)
        ways = {
            "per_expert_loop": lambda x=x, w=weights, i=ids: loop(x, i, w),
            "grouped": lambda x=x, w=weights, i=ids: grouped_experts(x, w13, w2, w, i),
        }
        if device.type == "cpu" and packed is not None:
            ways["grouped_packed"] = lambda x=x, w=weights, i=ids: grouped_experts(
                x,
                w13,
                w2,
                w,
                i,
                project=lambda rows, e, which: linear(rows, None, packed[which][e]),
            )
        if device.type == "cuda":
            from kernels.moe.triton_moe import fused_experts

            ways["fused"] = lambda x=x, w=weights, i=ids: fused_experts(x, w13, w2, w, i)
        with torch.inference_mode():
            reference = ways["per_expert_loop"]()
            for name, call in ways.items():
                seconds = _time(call, args.warmup, args.repeats, device)
                rows.append(
                    {
                        "tokens": num_tokens,
                        "way": name,
                        "ms": seconds * 1e3,
                        "max_abs_diff": float((call() - reference).abs().max()),
                    }
                )
        loop_ms = next(
            r["ms"] for r in rows if r["tokens"] == num_tokens and r["way"] == "per_expert_loop"
        )
        for row in rows:
            if row["tokens"] == num_tokens:
                row["speedup_vs_loop"] = loop_ms / row["ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")],
                        default=[1, 16, 256, 1024])  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="32 experts of 256 rows, hidden 512")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.experts, args.intermediate, args.hidden = 32, 256, 512
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    title = (
        f"MoE layer, {args.experts} experts x {args.intermediate} rows, hidden {args.hidden}, "
        f"top {args.top_k}, {args.device} {args.dtype}"
    )
    print(format_table(title, rows))
    if args.output_json:
        write_json(args.output_json, "moe_layer", vars(args), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
