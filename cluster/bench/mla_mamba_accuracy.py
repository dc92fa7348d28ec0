"""The MLA and Mamba Triton kernels against their torch references, in float32, bfloat16 and
float16, with the largest relative error of each. Part of ``python -m cluster.bench.gpu_check``.

    python -m cluster.bench.mla_mamba_accuracy            # on a GPU: DeepSeek/NemotronH sizes
    python -m cluster.bench.mla_mamba_accuracy --smoke    # CPU-sized: the Triton interpreter

MLA: the latent cache write must store exactly what the torch writer stores, in every layout,
and the split-KV decode (3 splits over uneven contexts) is held against the torch decode of
the same cache read in float64. Mamba: the conv1d and the SSD scan, prefill (a varlen batch
with and without initial states, prompts off chunk boundaries) and decode, each against the
torch reference (float32 maths) on the same inputs and states; outputs and the states written
back are both compared. The last line is the part's one-line summary.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcore
from cluster.bench.kernel_accuracy import DTYPES, print_summary
from kernels.attention.metadata import build_attention_metadata
from kernels.mamba import ConvWeights, SSDParams, VarlenBatch, get_mamba_backend
from kernels.mla import get_mla_backend
from kernels.mla.base import as_latent_view
from tests.kernels.cases import (
    DEVICE,
    make_cache,
    poisoned,
    randn,
    relative_error,
    strided_state,
)

# The largest relative error each dtype may show: a few units of its rounding.
BOUNDS = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
SEQ_LENS = [1, 70, 5, 33, 16, 47]  # uneven contexts: some of the 3 splits are empty
QUERY_LENS = [1, 3, 9, 17, 2, 40]  # Mamba prefill: none a multiple of the chunk
HAS_INITIAL = [True, False, True, False, True, True]
START_POSITIONS = [5, 0, 3, 0, 7, 14]
ROPE_SIZE = 64


@dataclass(frozen=True)
class Sizes:
    latent: int  # MLA kv_lora_rank
    mla_heads: int  # query heads per rank
    mamba_heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_dim: int
    chunk: int


SMOKE = Sizes(latent=32, mla_heads=4, mamba_heads=4, head_dim=8, state_size=16, groups=2,
              conv_dim=24, chunk=16)  # fmt: skip
# DeepSeek-V3 at TP 8 (512-wide latent, 16 heads); a NemotronH-H mixer at TP 4.
FULL = Sizes(latent=512, mla_heads=16, mamba_heads=32, head_dim=64, state_size=128, groups=2,
             conv_dim=2304, chunk=128)  # fmt: skip


def mla_errors(layout: str, dtype_name: str, sizes: Sizes) -> tuple[bool, float]:
    """(the Triton write is bit-exact, max relative error of the Triton decode)."""
    block_size, dtype = 16, DTYPES[dtype_name]
    width = sizes.latent + ROPE_SIZE
    spec = kvcore.MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=width, dtype=dtype_name
    )
    num_blocks = sum(-(-s // block_size) for s in SEQ_LENS) + 3
    ours, theirs = make_cache(layout, spec, num_blocks), make_cache(layout, spec, num_blocks)
    for cache in (ours, theirs):
        cache.raw.fill_(0x7F)  # cells nobody wrote read as huge numbers
    generator = torch.Generator().manual_seed(len(layout) + len(dtype_name))
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for seq_len in SEQ_LENS:
        tables.append(block_ids[: -(-seq_len // block_size)])
        block_ids = block_ids[len(tables[-1]) :]
    metadata = build_attention_metadata(SEQ_LENS, SEQ_LENS, tables, block_size, DEVICE)
    latent = randn((sum(SEQ_LENS), sizes.latent), dtype, generator)
    rope = randn((sum(SEQ_LENS), ROPE_SIZE), dtype, generator)
    triton, torch_backend = get_mla_backend("triton"), get_mla_backend("torch")
    triton.write_latent(latent, rope, ours.view, metadata.slot_mapping)
    torch_backend.write_latent(latent, rope, theirs.view, metadata.slot_mapping)
    q_latent = randn((len(SEQ_LENS), sizes.mla_heads, sizes.latent), dtype, generator)
    q_pe = randn((len(SEQ_LENS), sizes.mla_heads, ROPE_SIZE), dtype, generator)
    scale = (128 + ROPE_SIZE) ** -0.5  # DeepSeek's nope + rope head
    out = poisoned(tuple(q_latent.shape), dtype)
    args = (metadata.block_table, metadata.seq_lens, block_size, scale)
    triton.decode(q_latent, q_pe, ours.view, *args, num_splits=3, out=out)
    view64 = as_latent_view(theirs.view, sizes.latent, ROPE_SIZE).double()
    expected = torch_backend.decode(q_latent.double(), q_pe.double(), view64, *args)
    return bool(torch.equal(ours.raw, theirs.raw)), relative_error(out, expected)


@dataclass
class MambaInputs:
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H]
    B: torch.Tensor  # [T, G, N]
    C: torch.Tensor  # [T, G, N]
    params: SSDParams
    conv_x: torch.Tensor  # [T, D]
    conv: ConvWeights
    batch: VarlenBatch


def mamba_inputs(dtype: torch.dtype, sizes: Sizes, generator: torch.Generator) -> MambaInputs:
    num_tokens, heads = sum(QUERY_LENS), sizes.mamba_heads
    slots = torch.randperm(2 * len(QUERY_LENS), generator=generator)[: len(QUERY_LENS)]
    batch = VarlenBatch(
        slots.to(DEVICE, torch.int32), torch.tensor(HAS_INITIAL, device=DEVICE),
        torch.tensor([0, *QUERY_LENS]).cumsum(0).to(DEVICE, torch.int32),
        torch.tensor(START_POSITIONS, dtype=torch.int32, device=DEVICE), chunk_size=sizes.chunk,
    )  # fmt: skip
    params = SSDParams(
        A=-torch.exp(randn((heads,), torch.float32, generator) * 0.5),
        D=randn((heads,), dtype, generator), dt_bias=randn((heads,), dtype, generator) - 1.0,
    )  # fmt: skip
    state_shape = (num_tokens, sizes.groups, sizes.state_size)
    return MambaInputs(
        x=randn((num_tokens, heads, sizes.head_dim), dtype, generator),
        dt=randn((num_tokens, heads), dtype, generator),
        B=randn(state_shape, dtype, generator),
        C=randn(state_shape, dtype, generator), params=params,
        conv_x=randn((num_tokens, sizes.conv_dim), dtype, generator),
        conv=ConvWeights(randn((sizes.conv_dim, 4), dtype, generator) * 0.5,
                         randn((sizes.conv_dim,), dtype, generator)),
        batch=batch,
    )  # fmt: skip


def state_pair(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator):
    """Two strided state views (as kvcore lays slots out) holding the same random states."""
    ours, theirs = strided_state(shape, dtype), strided_state(shape, dtype)
    ours.copy_(randn(shape, dtype, generator) * 0.5)
    theirs.copy_(ours)
    return ours, theirs


def run_mamba(backend_name: str, inputs: MambaInputs, conv_state, ssm_state) -> dict:
    """Each kernel's output: a varlen prefill, then one decode token for every request."""
    backend, batch = get_mamba_backend(backend_name), inputs.batch
    rows, slots = batch.query_start_loc[1:] - 1, batch.state_indices  # each one's last token
    x, dt, B, C, params = inputs.x, inputs.dt, inputs.B, inputs.C, inputs.params
    return {
        "conv prefill": backend.conv1d_prefill(inputs.conv_x, inputs.conv, conv_state, batch),
        "conv decode": backend.conv1d_decode(inputs.conv_x[rows], inputs.conv, conv_state, slots),
        "ssd prefill": backend.ssd_prefill(x, dt, B, C, params, ssm_state, batch),
        "ssd decode": backend.ssd_decode(
            x[rows], dt[rows], B[rows], C[rows], params, ssm_state, slots
        ),
    }


def mamba_errors(dtype_name: str, sizes: Sizes) -> dict[str, float]:
    """Max relative error of each Mamba kernel's outputs and written states."""
    dtype, generator = DTYPES[dtype_name], torch.Generator().manual_seed(len(dtype_name))
    inputs, num_slots = mamba_inputs(dtype, sizes, generator), 2 * len(QUERY_LENS)
    conv_shape = (num_slots, 3, sizes.conv_dim)
    ssm_shape = (num_slots, sizes.mamba_heads, sizes.head_dim, sizes.state_size)
    conv_states = state_pair(conv_shape, dtype, generator)
    ssm_states = state_pair(ssm_shape, dtype, generator)
    ours = run_mamba("triton", inputs, conv_states[0], ssm_states[0])
    theirs = run_mamba("torch", inputs, conv_states[1], ssm_states[1])
    errors = {name: relative_error(ours[name], theirs[name]) for name in ours}
    errors["conv states"] = relative_error(conv_states[0], conv_states[1])
    errors["ssd states"] = relative_error(ssm_states[0], ssm_states[1])
    return errors


def check_dtype(dtype_name: str, layouts: list[str], sizes: Sizes) -> tuple[float, list[str]]:
    """Print one dtype's line; returns (its worst error, what exceeded the bound)."""
    bound, failures = BOUNDS[dtype_name], []
    mla = {layout: mla_errors(layout, dtype_name, sizes) for layout in layouts}
    inexact = [layout for layout, (exact, _) in mla.items() if not exact]
    worst_layout = max(mla, key=lambda layout: mla[layout][1])
    mamba = mamba_errors(dtype_name, sizes)
    worst_mamba = max(mamba, key=mamba.get)
    print(f"{dtype_name}: MLA decode max relative error {mla[worst_layout][1]:.2e} "
          f"({worst_layout}), latent write exact in {len(layouts) - len(inexact)}/{len(layouts)}"
          f" layouts; Mamba max {mamba[worst_mamba]:.2e} ({worst_mamba}); bound {bound:.0e}",
          flush=True)  # fmt: skip
    print("  " + ", ".join(f"{name} {error:.1e}" for name, error in mamba.items()), flush=True)
    failures += [f"{dtype_name} MLA decode in {lay}" for lay, (_, e) in mla.items() if e > bound]
    failures += [f"{dtype_name} latent write in {layout}" for layout in inexact]
    failures += [f"{dtype_name} Mamba {name}" for name, error in mamba.items() if error > bound]
    return max(mla[worst_layout][1], mamba[worst_mamba]), failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, two layouts (CI)")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    layouts = ["BLHNC", "LBHNC"] if args.smoke else kvcore.valid_layout_names()
    failures, summary = [], []
    for dtype_name in BOUNDS:
        worst, failed = check_dtype(dtype_name, layouts, sizes)
        failures += failed
        summary.append(f"{dtype_name} {worst:.1e}")
    over = f"{len(layouts)} layouts, latent {sizes.latent}"
    return print_summary("MLA/Mamba", summary, over, failures)


if __name__ == "__main__":
    sys.exit(main())
