"""``kvray serve``: a model on Ray behind gRPC and the OpenAI HTTP API, until SIGTERM (or
Ctrl-C), which drains."""

from __future__ import annotations

import os
import signal
import threading

from cluster.cli.flags import add_setting_flags, engine_config
from workers.model_source import model_config_for, model_display_name


def add_parser(commands, common) -> None:
    serve = commands.add_parser(
        "serve", parents=[common], help="serve a model over gRPC and HTTP on Ray"
    )
    add_setting_flags(serve, serving=True)


def run(args) -> int:
    import ray

    from cluster.controller import start_controller

    config = engine_config(args)
    model_config_for(config.model)  # a missing or unsupported model fails before Ray starts
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    handle, info = start_controller(config)
    print(_serving_line(config, info), flush=True)
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


def _serving_line(config, info: dict) -> str:
    http = f", OpenAI API at http://{info['http_address']}/v1" if info["http_address"] else ""
    return (
        f"kvray: serving {model_display_name(config.model)} on {info['address']} "
        f"(TP {config.tensor_parallel_size}){http}; KV cache: {info['num_blocks']} blocks, "
        f"{info['capacity_tokens']} tokens, max concurrency {info['max_concurrency']:.2f}x, "
        f"layout {info['layout']}"
    )
