"""``kvray bench``: throughput, serving latency, prefix caching, a decode step's cost by
context length and speculative decoding off vs on, printed as a table and optionally written as
JSON (``cluster.bench``)."""

from __future__ import annotations

import argparse

from cluster.cli.flags import (
    add_in_process_flag,
    add_server_address,
    add_setting_flags,
    engine_config,
)


def add_parser(commands, common) -> None:
    from cluster.bench.workload import parse_lengths, parse_range

    bench = commands.add_parser(
        "bench", help="measure throughput, latency, prefix caching, decode cost by context"
    )
    modes = bench.add_subparsers(dest="mode", required=True)
    reported = argparse.ArgumentParser(add_help=False, parents=[common])
    reported.add_argument("--seed", type=int, default=0)
    reported.add_argument("--output-json", default=None, help="also write the results here")
    shared = argparse.ArgumentParser(add_help=False, parents=[reported])
    shared.add_argument("--num-prompts", type=int, default=64)
    lengths = {"type": parse_range, "parse_lengths": parse_lengths}
    _add_throughput(modes, shared, lengths)
    _add_serve(modes, shared, lengths)
    _add_prefix(modes, shared)
    _add_decode(modes, reported, lengths)
    _add_speculative(modes, reported)


def _add_throughput(modes, shared, lengths) -> None:
    throughput = modes.add_parser(
        "throughput", parents=[shared], help="offline: all requests at once through an engine"
    )
    throughput.add_argument("--input-len", type=lengths["type"], default=(32, 256),
                            help="prompt lengths, e.g. 32-256 (default)")  # fmt: skip
    throughput.add_argument("--output-len", type=lengths["type"], default=(16, 256),
                            help="output lengths, e.g. 16-256 (default)")  # fmt: skip
    throughput.add_argument(
        "--compare",
        choices=["none", "transformers"],
        default="none",
        help="also run the requests through transformers' generate",
    )
    throughput.add_argument(
        "--hf-batch-size",
        type=int,
        default=16,
        help="static batch size of the transformers run (default 16)",
    )
    add_server_address(throughput, what="default: start an engine on Ray")
    add_in_process_flag(throughput)
    add_setting_flags(throughput)


def _add_serve(modes, shared, lengths) -> None:
    serve = modes.add_parser("serve", parents=[shared], help="latency against a running server")
    add_server_address(serve, what="required")
    serve.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no bound)",
    )
    serve.add_argument(
        "--workload",
        choices=["random", "multi-tenant"],
        default="random",
        help="random prompts (default), or shared system prompts, each request one of them "
        "with its own user turn (reports cached-token share and requests per replica)",
    )
    serve.add_argument("--input-len", type=lengths["type"], default=(32, 256),
                       help="random: prompt lengths (default 32-256)")  # fmt: skip
    serve.add_argument("--output-len", type=lengths["type"], default=(16, 256))
    serve.add_argument("--num-tenants", type=int, default=16,
                       help="multi-tenant: system prompts (default 16)")  # fmt: skip
    serve.add_argument("--system-prompt-len", type=int, default=256,
                       help="multi-tenant: tokens per system prompt (default 256)")  # fmt: skip
    serve.add_argument("--user-len", type=lengths["type"], default=(16, 64),
                       help="multi-tenant: user-turn lengths (default 16-64)")  # fmt: skip


def _add_prefix(modes, shared) -> None:
    prefix = modes.add_parser(
        "prefix", parents=[shared], help="a shared-prefix workload with caching on and off"
    )
    prefix.add_argument("--prompt-len", type=int, default=512)
    prefix.add_argument("--shared-fraction", type=float, default=0.9)
    prefix.add_argument("--output-len", type=int, default=16)
    add_in_process_flag(prefix)
    add_setting_flags(prefix)


def _add_decode(modes, reported, lengths) -> None:
    decode = modes.add_parser(
        "decode",
        parents=[reported],
        help="the time of one decode step at each context length (one in-process worker)",
    )
    decode.add_argument(
        "--context-lens",
        type=lengths["parse_lengths"],
        default=[256, 4096],
        help="comma-separated prompt lengths, one row each (default 256,4096)",
    )
    decode.add_argument(
        "--batch-size", type=int, default=8, help="requests decoding together (default 8)"
    )
    decode.add_argument(
        "--output-len", type=int, default=32, help="decode steps timed per row (default 32)"
    )
    decode.add_argument(
        "--warmup-steps",
        type=int,
        default=4,
        help="decode steps run before the timed ones (default 4)",
    )
    add_setting_flags(decode)


def _add_speculative(modes, reported) -> None:
    speculative = modes.add_parser(
        "speculative",
        parents=[reported],
        help="repeat-this-text requests, one at a time, with speculative decoding off and on",
    )
    speculative.add_argument("--num-prompts", type=int, default=4)
    speculative.add_argument(
        "--output-len", type=int, default=128, help="tokens per request (default 128)"
    )
    add_in_process_flag(speculative)
    add_setting_flags(speculative)


def run(args) -> int:
    from cluster.bench import modes
    from cluster.bench.report import format_table, write_json

    if args.mode == "serve":
        if args.server is None:
            raise ValueError("kvray bench serve needs --server HOST:PORT")
        rows = modes.serve(args)
    else:
        rows = getattr(modes, args.mode)(engine_config(args), args)
    print(format_table(f"kvray bench {args.mode}", rows))
    if args.output_json:
        settings = {k: v for k, v in vars(args).items() if k not in ("command", "mode")}
        write_json(args.output_json, args.mode, settings, rows)
    return 0
