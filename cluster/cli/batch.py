"""``kvray batch``: every line of a JSONL file generated for, results in input order; a bad
line is reported in the output and on stderr, and the others run."""

from __future__ import annotations

import sys

from cluster.cli.flags import add_server_address, add_setting_flags, engine_config
from cluster.launch import running_engine


def add_parser(commands, common) -> None:
    batch = commands.add_parser(
        "batch", parents=[common], help="generate for every line of a JSONL file, in order"
    )
    batch.add_argument(
        "--input",
        required=True,
        help="JSONL: one {prompt|prompt_token_ids, id?, sampling fields?} object per line",
    )
    batch.add_argument(
        "--output",
        required=True,
        help="JSONL results, one per input line; an existing file is resumed",
    )
    add_server_address(batch, what="default: start an engine on Ray")
    batch.add_argument(
        "--concurrency", type=int, default=64, help="requests in flight at once (default 64)"
    )
    add_setting_flags(batch)


def run(args) -> int:
    from cluster.batch import run_batch

    def on(address: str) -> int:
        summary = run_batch(
            address, args.input, args.output, api_key=args.api_key, concurrency=args.concurrency
        )
        print(
            f"kvray batch: {summary.num_succeeded} succeeded, {summary.num_failed} failed, "
            f"{summary.num_skipped} already done; results in {args.output}",
            file=sys.stderr,
        )
        return 0

    if args.server is not None:
        return on(args.server)
    with running_engine(engine_config(args)) as address:
        return on(address)
