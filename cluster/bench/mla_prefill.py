"""What one MLA layer's prefill chunk costs by each of its two strategies, expanded and latent.

A chunk of Q new tokens over a context of S tokens (the Q included) runs through the real
``MLAAttention.forward`` inside a real forward context, on a latent cache view built by kvcore
as the workers build it (the attention backend's first layout, ``--block-size`` tokens a block,
kernel blocks as ``workers.kv_cache`` picks them, a shuffled block table), filled with random
latents. The step metadata comes from ``build_mla_metadata``: with an expand budget of S the
chunk is expanded (context gathered, ``kv_b_proj`` up to per-head K/V, the attention
backend's paged prefill); with 0 it is latent (Q rows of the MLA backend's decode, absorbed
weights). Each strategy's time is the median of ``--repeats`` calls after ``--warmup``, the two
taking turns; only the layer's forward is timed, not the metadata (built once per step for
every layer). ``scratch_mib`` is what the expansion allocates for K/V, ``S x heads x (P + R +
V)`` elements; ``max_abs_diff`` compares the two strategies' outputs. A decode row (Q = 1) is
always latent, since the metadata expands prefills only: it has no expanded figure.

    python -m cluster.bench.mla_prefill            # CPU, fp32, one thread: about 30 s
    python -m cluster.bench.mla_prefill --quick    # fewer cases: about 10 s
    python -m cluster.bench.mla_prefill --device cuda --dtype bfloat16 --backend triton

On the CPU the torch MLA backend's decode (``kernels.mla.reference``) loops over its rows in
Python, gathering the row's whole context for each, so the latent time grows with Q x S
(about a microsecond per row and context token on one core): the default cases stop at Q x S
= 1024 x 1024. Torch runs one CPU thread unless ``--threads`` says otherwise: the latent
path's many small ops, each a parallel region, slow down many times over (and unevenly) when
other processes hold some of the cores, which would drown the comparison on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import kvcore
from cluster.bench.report import format_table, write_json
from kernels.attention import AttentionBackend, get_attention_backend
from kernels.mla import MLABackend, get_mla_backend
from kvcore.dtypes import MODEL_DTYPES
from kvcore.views import TORCH_DTYPES
from workers.forward_context import ForwardContext, set_forward_context
from workers.group_step import GroupStep
from workers.kinds.mla_metadata import MLAKernels, build_mla_metadata
from workers.kv_cache import select_kernel_block_size
from workers.layers.mla_attention import MLAAttention
from workers.model_config import MLAConfig
from workers.options import RankSettings

# DeepSeek-V3's attention; 128 query heads, one rank's share under TP 8 by default.
DEEPSEEK_V3 = MLAConfig(
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, rope_interleave=True, attention_bias=False,
)  # fmt: skip
DEFAULT_CASES = "128x128,512x512,1024x1024,128x2048,16x2048,32x4096,8x4096,1x2048"  # Q x S
QUICK_CASES = "128x128,512x512,128x2048,16x2048,1x2048"
NUM_LAYERS = 2  # so that layer-inner layouts really interleave the layers
LAYER_NAME = "layer.1"


@dataclass(frozen=True)
class Setup:
    """One layer with its cache, and the backends a step hands it."""

    layer: MLAAttention
    kv_b_weight: torch.Tensor  # [H * (P + V), L]
    backend: AttentionBackend
    mla_backend: MLABackend
    block_rows: torch.Tensor  # [1, W] int32 host table of the one request's blocks
    block_size: int
    device: torch.device
    dtype: torch.dtype


def build_setup(args, max_seq_len: int) -> Setup:
    mla, device, dtype = DEEPSEEK_V3, torch.device(args.device), TORCH_DTYPES[args.dtype]
    backend, mla_backend = get_attention_backend(args.backend), get_mla_backend(args.backend)
    layer = MLAAttention(LAYER_NAME, args.num_heads, mla, scale=mla.qk_head_dim**-0.5)
    num_request_blocks = -(-max_seq_len // args.block_size)
    num_blocks = num_request_blocks + 1  # block 0 is the null block
    layer.kv_cache = latent_cache(args, backend, num_blocks, device, dtype)
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # shuffled pages
    shape = (args.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    kv_b_weight = torch.randn(shape, generator=generator) * mla.kv_lora_rank**-0.5
    return Setup(
        layer=layer,
        kv_b_weight=kv_b_weight.to(device, dtype),
        backend=backend,
        mla_backend=mla_backend,
        block_rows=order[None, :].to(torch.int32),
        block_size=args.block_size,
        device=device,
        dtype=dtype,
    )


def latent_cache(args, backend, num_blocks: int, device, dtype) -> torch.Tensor:
    """The layer's ``[B, 1, N, C]`` view, as ``workers.kv_cache`` builds it, random latents."""
    spec = kvcore.MLAAttentionSpec(
        block_size=args.block_size,
        num_kv_heads=1,
        head_size=DEEPSEEK_V3.latent_size,
        head_size_v=0,
        dtype=str(dtype).removeprefix("torch."),
    )
    layout = backend.supported_kv_cache_layouts()[0]
    names = [f"layer.{i}" for i in range(NUM_LAYERS)]
    tensor = kvcore.build_kv_cache_tensor(spec, names, num_blocks, layout)
    raw = torch.zeros(tensor.size, dtype=torch.int8, device=device)
    kernel_block_size = select_kernel_block_size(args.block_size, backend)
    views = kvcore.create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size)
    view = views[LAYER_NAME]
    cells = view[..., : DEEPSEEK_V3.latent_size]  # [B, 1, N, L + R]
    cells.copy_(torch.randn(cells.shape, generator=torch.Generator().manual_seed(args.seed)))
    return view


def chunk_inputs(setup: Setup, query_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q_nope ``[Q, H, P]``, q_pe ``[Q, H, R]``, kv_c ``[Q, L]``, k_pe ``[Q, R]``."""
    mla, num_heads = DEEPSEEK_V3, setup.layer.num_heads
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (query_len, num_heads, mla.qk_nope_head_dim),
        (query_len, num_heads, mla.qk_rope_head_dim),
        (query_len, mla.kv_lora_rank),
        (query_len, mla.qk_rope_head_dim),
    ]
    return tuple(
        torch.randn(shape, generator=generator).to(setup.device, setup.dtype) for shape in shapes
    )


def time_forwards(setup: Setup, metadatas: list, inputs, args) -> list[tuple[float, torch.Tensor]]:
    """(median ms, the output) of the layer's forward under each of ``metadatas``. The
    strategies take turns call by call, so a load that comes and goes on a shared machine
    slows each of them alike."""
    times = [[] for _ in metadatas]
    outs = [None] * len(metadatas)
    for index in range(args.warmup + args.repeats):
        for i, metadata in enumerate(metadatas):
            ms, outs[i] = timed_forward(setup, metadata, inputs)
            if index >= args.warmup:
                times[i].append(ms)
    return [(statistics.median(t), out) for t, out in zip(times, outs, strict=True)]


def timed_forward(setup: Setup, metadata, inputs) -> tuple[float, torch.Tensor]:
    kernels = MLAKernels(setup.mla_backend, setup.backend)
    context = ForwardContext({LAYER_NAME: GroupStep(metadata, kernels)})
    is_cuda = setup.device.type == "cuda"
    with set_forward_context(context), torch.inference_mode():
        if is_cuda:
            torch.cuda.synchronize(setup.device)
        started = time.perf_counter()
        out = setup.layer(*inputs, setup.kv_b_weight)
        if is_cuda:
            torch.cuda.synchronize(setup.device)  # kernels run asynchronously
        return (time.perf_counter() - started) * 1e3, out


def measure_case(setup: Setup, query_len: int, seq_len: int, args) -> dict:
    lens = ([query_len], [seq_len])
    rows = setup.block_rows[:, : -(-seq_len // setup.block_size)]
    attention = setup.backend.build_metadata(*lens, rows, setup.block_size, setup.device)
    latent = build_mla_metadata(attention, *lens, rows, setup.device, expand_budget=0)
    expanded = build_mla_metadata(attention, *lens, rows, setup.device, expand_budget=seq_len)
    inputs = chunk_inputs(setup, query_len, args.seed + seq_len)
    row = {"query_len": query_len, "seq_len": seq_len}
    if expanded.expanded is None:  # a decode row: the metadata expands prefills only
        [(latent_ms, _)] = time_forwards(setup, [latent], inputs, args)
        missing = dict.fromkeys(("latent_vs_expanded", "scratch_mib", "max_abs_diff"), "-")
        return row | {"expanded_ms": "-", "latent_ms": latent_ms} | missing
    timings = time_forwards(setup, [expanded, latent], inputs, args)
    (expanded_ms, expanded_out), (latent_ms, latent_out) = timings
    mla = DEEPSEEK_V3
    scratch = seq_len * setup.layer.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    diff = (expanded_out.float() - latent_out.float()).abs().max().item()
    return row | {
        "expanded_ms": expanded_ms,
        "latent_ms": latent_ms,
        "latent_vs_expanded": latent_ms / expanded_ms,
        "scratch_mib": scratch * setup.dtype.itemsize / 2**20,
        "max_abs_diff": f"{diff:.1e}",
    }


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        query_len, _, seq_len = item.strip().lower().partition("x")
        if not (query_len.isdigit() and seq_len.isdigit()):
            raise ValueError(f"--cases takes QxS pairs (e.g. 128x2048), got {item!r}")
        if not 1 <= int(query_len) <= int(seq_len):
            raise ValueError(f"--cases {item}: need 1 <= Q <= S")
        cases.append((int(query_len), int(seq_len)))
    return cases


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", default="cpu", help="cpu or cuda")
    add("--dtype", choices=sorted(MODEL_DTYPES), default="float32")
    add("--backend", choices=["torch", "triton"], default="torch", help="attention and MLA both")
    add("--num-heads", type=int, default=16, help="query heads on this rank")
    add("--block-size", type=int, default=RankSettings.default("block_size"))
    add("--cases", default=None, help=f"QxS pairs (default {DEFAULT_CASES})")
    add("--quick", action="store_true", help=f"cases {QUICK_CASES}: about 10 s on a CPU")
    add("--warmup", type=int, default=1)
    add("--repeats", type=int, default=5)
    add("--threads", type=int, default=1, help="torch's CPU threads; 0: its own choice")
    add("--seed", type=int, default=0)
    add("--output-json", default=None)
    args = parser.parse_args(argv)
    try:
        args.cases = parse_cases(args.cases or (QUICK_CASES if args.quick else DEFAULT_CASES))
    except ValueError as exc:
        parser.error(str(exc))
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be at least 0 and --repeats at least 1")
    if args.backend == "triton" and args.device == "cpu":
        parser.error("--backend triton runs on a GPU: add --device cuda")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    setup = build_setup(args, max(s for _, s in args.cases))
    rows = [measure_case(setup, q, s, args) for q, s in args.cases]
    mla = DEEPSEEK_V3
    title = (
        f"MLA prefill, one layer: {args.num_heads} heads, L {mla.kv_lora_rank}, R "
        f"{mla.qk_rope_head_dim}, P {mla.qk_nope_head_dim}, V {mla.v_head_dim}; {args.device} "
        f"{args.dtype}, {args.backend} backends, block {args.block_size}, "
        f"threads {torch.get_num_threads()}; median of {args.repeats} after {args.warmup} warm-up"
    )
    print(format_table(title, rows))
    if args.output_json:
        write_json(args.output_json, "mla_prefill", vars(args), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
