"""The ``kvray`` command: ``serve``, ``generate``, ``chat``, ``batch``, ``bench`` and ``plan``.

Flags follow vLLM's names where the two overlap; every ``serve`` flag that has a ``KVRAY_*``
variable takes its default from it (see ``cluster.env``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.config import DEFAULT_HTTP_PORT, DEFAULT_PORT, EngineConfig
from cluster.env import env_default, parse_bytes

engine_default = EngineConfig.default  # help texts show the one definition of each default


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=env_default("KVRAY_MODEL"),
        help="Hugging Face model directory (default: the embedded tiny model)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help=f"TP ranks, one worker actor each (default {engine_default('tensor_parallel_size')})",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per KV block (default {engine_default('block_size')})",
    )
    g.add_argument(
        "--kv-cache-layout",
        default=env_default("KVRAY_KV_CACHE_LAYOUT"),
        help="LBHNC LBNHC LHBNC BLHNC BLNHC BHLNC, or NHD/HND "
        "(default: the backend's first choice)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV cache of shared prompt prefixes (default on)",
    )
    g.add_argument(
        "--mamba-state-interval",
        type=int,
        default=None,
        help="hybrid models: tokens between the Mamba states kept for prefix caching, a "
        "multiple of --block-size; a shared prefix hits at its last multiple of it (default "
        f"{engine_default('mamba_state_interval')})",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of each GPU kvray may use "
        f"(default {engine_default('gpu_memory_utilization')})",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=env_default("KVRAY_KV_CACHE_MEMORY", "1GiB"),
        help="KV cache size per rank on CPU workers, e.g. 512MiB (default 1GiB); ignored on GPUs",
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="use exactly this many KV blocks (testing)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"requests running at once (default {engine_default('max_num_seqs')})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens per engine step (default {engine_default('max_num_batched_tokens')})",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="waiting requests before new ones are refused "
        f"(default {engine_default('max_queue_len')})",
    )
    g.add_argument(
        "--attention-backend",
        default=env_default("KVRAY_ATTENTION_BACKEND"),
        help="torch or triton (default: triton on GPU workers, torch on CPU ones)",
    )
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="weights and KV cache dtype (default: the checkpoint's)",
    )
    g.add_argument(
        "--cpus-per-worker",
        type=int,
        default=None,
        help="CPUs each worker reserves and computes with (default: 1 beside a GPU; on "
        "CPU-only clusters, this node's CPUs divided among the TP ranks)",
    )
    g.add_argument(
        "--placement-strategy",
        default=None,
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        help=f"how TP ranks spread over nodes (default {engine_default('placement_strategy')})",
    )


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=env_default("KVRAY_HOST", "127.0.0.1"),
        help="address to bind (default 127.0.0.1; 0.0.0.0 for every interface)",
    )
    g.add_argument(
        "--port",
        type=int,
        default=int(env_default("KVRAY_PORT", DEFAULT_PORT)),
        help=f"gRPC port (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    g.add_argument(
        "--http-port",
        type=http_port,
        default=DEFAULT_HTTP_PORT,
        help=f"port of the OpenAI-compatible HTTP API (default {DEFAULT_HTTP_PORT}; 0 picks a "
        "free one; 'off' serves gRPC only)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the APIs (default: the --model path or embedded name)",
    )
    g.add_argument(
        "--api-key",
        default=env_default("KVRAY_API_KEY"),
        help="require 'authorization: Bearer <key>' on every gRPC call but health and on the "
        "HTTP /v1 routes",
    )
    g.add_argument(
        "--max-request-body",
        default=None,
        help="the largest request either API reads, e.g. 8MiB: bigger HTTP bodies get 413 "
        "before they are parsed, bigger gRPC messages RESOURCE_EXHAUSTED (default "
        f"{engine_default('max_request_body_bytes') >> 20}MiB)",
    )
    g.add_argument(
        "--max-rebuild-attempts",
        type=int,
        default=None,
        help="after a worker is lost, rebuild the worker group up to this many times before "
        f"giving up (default {engine_default('max_rebuild_attempts')}; 0: stop at the first)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are "
        f"aborted (default {engine_default('drain_timeout_s'):g})",
    )


def http_port(text: str) -> int | None:
    if text.strip().lower() in ("off", "none", "no"):
        return None
    return int(text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The settings the command line gives; what it leaves out keeps EngineConfig's default."""
    given = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_layout": args.kv_cache_layout,
        "enable_prefix_caching": args.enable_prefix_caching,
        "mamba_state_interval": args.mamba_state_interval,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": parse_bytes(args.kv_cache_memory),
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_queue_len": args.max_queue_len,
        "attention_backend": args.attention_backend,
        "dtype": args.dtype,
        "placement_strategy": args.placement_strategy,
        "cpus_per_worker": args.cpus_per_worker,
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", 0),
        "api_key": getattr(args, "api_key", None),
        "http_port": getattr(args, "http_port", None),
        "served_model_name": getattr(args, "served_model_name", None),
        "drain_timeout_s": getattr(args, "drain_timeout", None),
        "max_rebuild_attempts": getattr(args, "max_rebuild_attempts", None),
        "max_request_body_bytes": parse_bytes(getattr(args, "max_request_body", None)),
    }
    # http_port None means "off": it is given, not left out, whenever the command has the flag.
    keep = {"http_port"} if hasattr(args, "http_port") else set()
    return EngineConfig(**{k: v for k, v in given.items() if v is not None or k in keep})


def add_in_process_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run one rank in this process instead of on Ray (TP 1 only; faster to start; "
        "the figures then include the client's share of this interpreter)",
    )


def add_bench_parser(commands, common) -> None:
    from cluster.bench.deepseek_checkpoint import DEFAULT_LAYERS as DEEPSEEK_LAYERS
    from cluster.bench.deepseek_checkpoint import DEFAULT_Q_LORA_RANK as DEEPSEEK_Q_LORA_RANK
    from cluster.bench.hybrid_checkpoint import DEFAULT_PATTERN
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

    throughput = modes.add_parser(
        "throughput", parents=[shared], help="offline: all requests at once through an engine"
    )
    throughput.add_argument(
        "--input-len",
        type=parse_range,
        default=(32, 256),
        help="prompt lengths, e.g. 32-256 (default)",
    )
    throughput.add_argument(
        "--output-len",
        type=parse_range,
        default=(16, 256),
        help="output lengths, e.g. 16-256 (default)",
    )
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
    throughput.add_argument(
        "--server",
        default=None,
        help="HOST:PORT of a running server to measure (default: start an engine on Ray)",
    )
    throughput.add_argument("--api-key", default=env_default("KVRAY_API_KEY"))
    add_in_process_flag(throughput)
    add_engine_flags(throughput)

    serve = modes.add_parser("serve", parents=[shared], help="latency against a running server")
    serve.add_argument("--server", required=True, help="HOST:PORT")
    serve.add_argument("--api-key", default=env_default("KVRAY_API_KEY"))
    serve.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    serve.add_argument("--input-len", type=parse_range, default=(32, 256))
    serve.add_argument("--output-len", type=parse_range, default=(16, 256))

    prefix = modes.add_parser(
        "prefix", parents=[shared], help="a shared-prefix workload with caching on and off"
    )
    prefix.add_argument("--prompt-len", type=int, default=512)
    prefix.add_argument("--shared-fraction", type=float, default=0.9)
    prefix.add_argument("--output-len", type=int, default=16)
    add_in_process_flag(prefix)
    add_engine_flags(prefix)

    decode = modes.add_parser(
        "decode",
        parents=[reported],
        help="the time of one decode step at each context length (one in-process worker)",
    )
    decode.add_argument(
        "--context-lens",
        type=parse_lengths,
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
    add_engine_flags(decode)

    make_hybrid = modes.add_parser(
        "make-hybrid",
        parents=[common],
        help="write a random-weight ~18M-parameter NemotronH (Mamba-2 hybrid) checkpoint to "
        "compare against embedded:20m (needs transformers)",
    )
    make_hybrid.add_argument("output_dir", help="a new or empty directory")
    make_hybrid.add_argument(
        "--pattern",
        default=DEFAULT_PATTERN,
        help=f"one letter a layer: M Mamba-2, * attention, - MLP (default {DEFAULT_PATTERN})",
    )
    make_hybrid.add_argument("--seed", type=int, default=0)

    make_deepseek = modes.add_parser(
        "make-deepseek",
        parents=[common],
        help="write a random-weight ~16M-parameter dense DeepSeek-V3 (multi-head latent "
        "attention) checkpoint (needs transformers)",
    )
    make_deepseek.add_argument("output_dir", help="a new or empty directory")
    make_deepseek.add_argument(
        "--layers",
        type=int,
        default=DEEPSEEK_LAYERS,
        help=f"decoder layers, each MLA and a dense MLP (default {DEEPSEEK_LAYERS})",
    )
    make_deepseek.add_argument(
        "--q-lora-rank",
        type=int,
        default=DEEPSEEK_Q_LORA_RANK,
        help=f"the query's low-rank width; 0 for a plain q_proj (default {DEEPSEEK_Q_LORA_RANK})",
    )
    make_deepseek.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvray", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        default=env_default("KVRAY_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", parents=[common], help="serve a model over gRPC on Ray")
    add_engine_flags(serve)
    add_server_flags(serve)

    generate = commands.add_parser(
        "generate", parents=[common], help="generate once, against a server or locally"
    )
    generate.add_argument(
        "--server",
        default=None,
        help="HOST:PORT of a running server (default: start a local engine)",
    )
    generate.add_argument("--api-key", default=env_default("KVRAY_API_KEY"))
    add_in_process_flag(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    generate.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate at most (default 16, or fewer when the prompt leaves less room)",
    )
    # Unset sampling fields take the server's defaults (the model's generation_config.json).
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=None, help="a stop string (repeat)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument(
        "--output",
        choices=["text", "json"],
        default="text",
        help="text streams the completion; json prints it with token ids",
    )
    add_engine_flags(generate)

    chat = commands.add_parser(
        "chat",
        parents=[common],
        help="talk to a chat model: one question (--prompt), or a conversation on stdin",
    )
    chat.add_argument("--server", default=None, help="HOST:PORT (default: start a local engine)")
    chat.add_argument("--api-key", default=env_default("KVRAY_API_KEY"))
    chat.add_argument("--prompt", default=None, help="one question; without it, read turns")
    chat.add_argument("--system", default=None, help="a system message first")
    chat.add_argument("--max-tokens", type=int, default=256, help="per answer (default 256)")
    chat.add_argument("--temperature", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    add_in_process_flag(chat)
    add_engine_flags(chat)

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
    batch.add_argument(
        "--server",
        default=None,
        help="HOST:PORT of a running server (default: start an engine on Ray)",
    )
    batch.add_argument("--api-key", default=env_default("KVRAY_API_KEY"))
    batch.add_argument(
        "--concurrency", type=int, default=64, help="requests in flight at once (default 64)"
    )
    add_engine_flags(batch)

    add_bench_parser(commands, common)

    plan = commands.add_parser(
        "plan", parents=[common], help="print the KV-cache plan without loading weights"
    )
    add_engine_flags(plan)
    plan.add_argument(
        "--layouts",
        default="all",
        help="comma-separated layouts to show strides for (default: all six)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from cluster import commands

    try:
        return getattr(commands, args.command)(args)  # one function per subcommand
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one readable line, not a traceback (see cluster.cli_errors)
        from cluster.cli_errors import report

        return report(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
