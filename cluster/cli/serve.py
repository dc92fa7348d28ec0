"""``kvray serve``: a model on Ray behind gRPC and the OpenAI HTTP API, until SIGTERM (or
Ctrl-C), which drains. One engine in a controller actor; with ``--data-parallel-size N`` or
``--autoscale MIN:MAX``, engine replicas on Ray Serve (``cluster.serve``)."""

from __future__ import annotations

import os
import signal
import time

from cluster.cli.flags import add_setting_flags, engine_config
from workers.model_source import model_config_for, model_display_name


def add_parser(commands, common) -> None:
    serve = commands.add_parser(
        "serve", parents=[common], help="serve a model over gRPC and HTTP on Ray"
    )
    add_setting_flags(serve, serving=True)


def run(args) -> int:
    import ray

    from cluster.startup import check_expert_split

    config = engine_config(args)
    # A missing or unsupported model, or one that cannot be split so, fails before Ray starts.
    check_expert_split(model_config_for(config.model), config)
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    server = _Replicas(config) if config.uses_replicas else _Controller(config)
    print(server.serving_line(), flush=True)
    # A flag, not a threading.Event: Event.set in a handler deadlocks when a second signal
    # lands while the main thread holds the Event's lock (SIGTERM from both kubelet and a
    # supervisor, or from `timeout` and its child's group).
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _: signals.append(number))
    while not signals:
        time.sleep(0.1)
    # Health turns NOT_SERVING and new requests are refused at once; running ones may finish.
    print(
        f"kvray: draining (up to {config.drain_timeout_s:g} s for requests in flight)",
        flush=True,
    )
    aborted = server.drain(config.drain_timeout_s)
    print(f"kvray: shutting down ({aborted} request(s) aborted at the deadline)", flush=True)
    server.stop()
    ray.shutdown()
    return 0


def parallelism(config) -> str:
    """The ranks in words: TP 2, or PP 2 x TP 2 with pipeline stages."""
    tp = f"TP {config.tensor_parallel_size}"
    if config.pipeline_parallel_size == 1:
        return tp
    return f"PP {config.pipeline_parallel_size} x {tp}"


class _Controller:
    """One engine: the controller actor hosts it and its servers."""

    def __init__(self, config):
        from cluster.controller import start_controller

        self.config = config
        self.handle, self.info = start_controller(config)

    def serving_line(self) -> str:
        info, config = self.info, self.config
        http = f", OpenAI API at http://{info['http_address']}/v1" if info["http_address"] else ""
        return (
            f"kvray: serving {model_display_name(config.model)} on {info['address']} "
            f"({parallelism(config)}){http}; KV cache: {info['num_blocks']} blocks, "
            f"{info['capacity_tokens']} tokens, max concurrency {info['max_concurrency']:.2f}x, "
            f"layout {info['layout']}"
        )

    def drain(self, timeout: float) -> int:
        import ray

        return ray.get(self.handle.drain.remote(timeout))

    def stop(self) -> None:
        import ray

        ray.get(self.handle.stop.remote())


class _Replicas:
    """Engine replicas on Ray Serve, behind its ingress."""

    def __init__(self, config):
        from cluster.serve.app import start_replicas

        self.config = config
        self.ingress, self.http_address = start_replicas(config)
        self.address = self.ingress.grpc_address.remote().result()
        self._wait_for_reports(
            config.replica_range[0] if config.replica_range else config.data_parallel_size
        )

    def _wait_for_reports(self, replicas: int, timeout: float = 60.0) -> None:
        """Until every replica Serve started has reported its cache to the router (within a
        second of starting), so GetServerInfo lists them all from the first request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if len(self.ingress.info.remote().result()["replicas"]) >= replicas:
                    return
            except Exception:  # none has reported yet: GetServerInfo says UNAVAILABLE
                pass
            time.sleep(0.2)

    def serving_line(self) -> str:
        config = self.config
        replicas = config.autoscale or config.data_parallel_size
        http = f", OpenAI API at http://{self.http_address}/v1" if self.http_address else ""
        return (
            f"kvray: serving {model_display_name(config.model)} on {self.address} with "
            f"{replicas} replica(s) on Ray Serve ({parallelism(config)} each, "
            f"{config.routing_policy} routing){http}"
        )

    def drain(self, timeout: float) -> int:
        return self.ingress.drain.remote(timeout).result()

    def stop(self) -> None:
        from cluster.serve.app import stop_replicas

        stop_replicas()
