"""``kvray make-checkpoint hybrid|deepseek|moe DIR``: the random-weight checkpoints the benchmarks
and tests load (``cluster.fixtures``), written by transformers (which they need)."""

from __future__ import annotations

from pathlib import Path

from cluster.fixtures.deepseek_checkpoint import DEFAULT_LAYERS, DEFAULT_Q_LORA_RANK
from cluster.fixtures.hybrid_checkpoint import DEFAULT_PATTERN
from cluster.fixtures.moe_checkpoint import DEFAULT_EXPERTS, DEFAULT_TOP_K


def add_parser(commands, common) -> None:
    make = commands.add_parser(
        "make-checkpoint", help="write a random-weight checkpoint to compare engines on"
    )
    kinds = make.add_subparsers(dest="kind", required=True)
    hybrid = kinds.add_parser(
        "hybrid",
        parents=[common],
        help="a ~18M-parameter NemotronH (Mamba-2 hybrid), the sibling of embedded:20m",
    )
    hybrid.add_argument("output_dir", help="a new or empty directory")
    hybrid.add_argument(
        "--pattern",
        default=DEFAULT_PATTERN,
        help=f"one letter a layer: M Mamba-2, * attention, - MLP (default {DEFAULT_PATTERN})",
    )
    hybrid.add_argument("--seed", type=int, default=0)
    deepseek = kinds.add_parser(
        "deepseek",
        parents=[common],
        help="a ~16M-parameter dense DeepSeek-V3 (multi-head latent attention)",
    )
    deepseek.add_argument("output_dir", help="a new or empty directory")
    deepseek.add_argument(
        "--layers",
        type=int,
        default=DEFAULT_LAYERS,
        help=f"decoder layers, each MLA and a dense MLP (default {DEFAULT_LAYERS})",
    )
    deepseek.add_argument(
        "--q-lora-rank",
        type=int,
        default=DEFAULT_Q_LORA_RANK,
        help=f"the query's low-rank width; 0 for a plain q_proj (default {DEFAULT_Q_LORA_RANK})",
    )
    deepseek.add_argument("--seed", type=int, default=0)
    moe = kinds.add_parser(
        "moe",
        parents=[common],
        help="a ~19M-parameter Qwen3-MoE (mixture of experts), the sibling of embedded:20m",
    )
    moe.add_argument("output_dir", help="a new or empty directory")
    moe.add_argument("--experts", type=int, default=DEFAULT_EXPERTS,
                     help=f"experts per layer (default {DEFAULT_EXPERTS})")  # fmt: skip
    moe.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                     help=f"experts each token runs (default {DEFAULT_TOP_K})")  # fmt: skip
    moe.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    moe.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    directory = Path(args.output_dir)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: give a new or empty directory")
    if args.kind == "hybrid":
        from cluster.fixtures.hybrid_checkpoint import save_hybrid_checkpoint

        num_params = save_hybrid_checkpoint(directory, args.pattern, args.seed)
        what = f"NemotronH checkpoint, layers {args.pattern}"
    elif args.kind == "moe":
        from cluster.fixtures.moe_checkpoint import save_moe_checkpoint

        num_params = save_moe_checkpoint(
            directory, args.experts, args.top_k, args.layers, args.seed
        )
        what = (
            f"Qwen3-MoE checkpoint, {args.layers} layers of {args.experts} experts, "
            f"{args.top_k} per token"
        )
    else:
        from cluster.fixtures.deepseek_checkpoint import save_deepseek_checkpoint

        q_lora_rank = args.q_lora_rank or None
        num_params = save_deepseek_checkpoint(directory, args.layers, q_lora_rank, args.seed)
        what = (
            f"DeepSeek-V3 checkpoint (dense, MLA), {args.layers} layers, q_lora_rank {q_lora_rank}"
        )
    params = f"{num_params / 1e6:.1f}M parameters"
    print(f"{what}, {params}, random weights (seed {args.seed}): {directory}")
    return 0
