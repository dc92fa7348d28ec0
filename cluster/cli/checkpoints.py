"""``kvray make-checkpoint hybrid|deepseek DIR``: the random-weight checkpoints the benchmarks
and tests load (``cluster.fixtures``), written by transformers (which they need)."""

from __future__ import annotations

from pathlib import Path

from cluster.fixtures.deepseek_checkpoint import DEFAULT_LAYERS, DEFAULT_Q_LORA_RANK
from cluster.fixtures.hybrid_checkpoint import DEFAULT_PATTERN


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


def run(args) -> int:
    directory = Path(args.output_dir)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: give a new or empty directory")
    if args.kind == "hybrid":
        from cluster.fixtures.hybrid_checkpoint import save_hybrid_checkpoint

        num_params = save_hybrid_checkpoint(directory, args.pattern, args.seed)
        what = f"NemotronH checkpoint, layers {args.pattern}"
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
