"""What each ``kvray`` subcommand does (argument parsing lives in ``cluster.cli``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from contextlib import contextmanager

from cluster.cli import engine_config
from cluster.client import Client
from cluster.launch import running_engine
from workers.model_source import model_config_for, model_display_name


def serve(args) -> int:
    import ray

    from cluster.controller import start_controller

    config = engine_config(args)
    model_config_for(config.model)  # a missing or unsupported model fails before Ray starts
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    handle, info = start_controller(config)
    http = f", OpenAI API at http://{info['http_address']}/v1" if info["http_address"] else ""
    print(
        f"kvray: serving {model_display_name(config.model)} on {info['address']} "
        f"(TP {config.tensor_parallel_size}){http}; KV cache: {info['num_blocks']} blocks, "
        f"{info['capacity_tokens']} tokens, max concurrency {info['max_concurrency']:.2f}x, "
        f"layout {info['layout']}",
        flush=True,
    )
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    # Health turns NOT_SERVING and new requests are refused at once; running ones may finish.
    print(
        f"kvray: draining (up to {config.drain_timeout_s:g} s for requests in flight)",
        flush=True,
    )
    aborted = ray.get(handle.drain.remote(config.drain_timeout_s))
    print(f"kvray: shutting down ({aborted} request(s) aborted at the deadline)", flush=True)
    ray.get(handle.stop.remote())
    ray.shutdown()
    return 0


def _sampling(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _prompt(args):
    if args.prompt is not None:
        return args.prompt
    try:
        return [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
    except ValueError:
        raise ValueError("--prompt-token-ids takes comma-separated integers, e.g. 1,2,3") from None


@contextmanager
def _client(args):
    """A client of --server, or of an engine started for this command (stopped after)."""
    if args.server is not None:
        with Client(args.server, api_key=args.api_key) as client:
            yield client
        return
    with (
        running_engine(engine_config(args), in_process=args.in_process) as address,
        Client(address) as client,
    ):
        yield client


def generate(args) -> int:
    with _client(args) as client:
        return _print_generation(client, args)


def chat(args) -> int:
    with _client(args) as client:
        return _converse(client, args)


def _converse(client: Client, args) -> int:
    """One answer to --prompt, or turns read from stdin (an empty line or EOF ends it); the
    answers stream, and the conversation so far goes with each turn."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    turns = [args.prompt] if args.prompt is not None else _read_turns()
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = ""
        for delta in client.stream(messages, **sampling):
            answer += delta.text
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": answer})
    return 0


def _read_turns():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line.strip():
            return
        yield line.rstrip("\n")


def batch(args) -> int:
    from cluster.batch import run_batch

    def run(address: str) -> int:
        summary = run_batch(
            address, args.input, args.output, api_key=args.api_key, concurrency=args.concurrency
        )
        print(
            f"kvray batch: {summary.num_succeeded} succeeded, {summary.num_failed} failed, "
            f"{summary.num_skipped} already done; results in {args.output}",
            file=sys.stderr,
        )
        return 0  # bad lines are reported in the output and on stderr; the rest ran

    if args.server is not None:
        return run(args.server)
    with running_engine(engine_config(args)) as address:
        return run(address)


def _print_generation(client: Client, args) -> int:
    prompt, sampling = _prompt(args), _sampling(args)
    if args.output == "json":
        completion = client.generate(prompt, **sampling)
        print(
            json.dumps(
                {
                    "request_id": completion.request_id,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                    "usage": vars(completion.usage),
                }
            )
        )
        return 0
    for delta in client.stream(prompt, **sampling):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def bench(args) -> int:
    from cluster.bench import modes
    from cluster.bench.report import format_table, write_json

    if args.mode == "make-hybrid":
        return modes.make_hybrid(args)
    if args.mode == "make-deepseek":
        return modes.make_deepseek(args)
    if args.mode == "serve":
        rows = modes.serve(args)
    else:
        rows = getattr(modes, args.mode)(engine_config(args), args)
    print(format_table(f"kvray bench {args.mode}", rows))
    if args.output_json:
        settings = {k: v for k, v in vars(args).items() if k not in ("command", "mode")}
        write_json(args.output_json, args.mode, settings, rows)
    return 0


def plan(args) -> int:
    from cluster.plan_report import plan_report

    config = engine_config(args)
    model_config = model_config_for(config.model)
    layouts = None if args.layouts == "all" else args.layouts.split(",")
    print(plan_report(config, model_config, layouts))
    return 0
