"""The Serve application ``kvray serve --data-parallel-size N`` (or ``--autoscale MIN:MAX``)
runs: the engine replicas, each in a placement group of one bundle per TP rank (the replica
actor takes no CPU: only worker bundles reserve resources), routed by ``KVRayRouter``; and
the ingress (no CPU either), which serves gRPC itself on ``--port`` of a known node: the one
``kvray serve`` runs on, or the head for a RayService, whose ``import_path`` is
``cluster.serve.app:application`` (its ``args`` are ``kvray serve`` settings)."""

from __future__ import annotations

import msgspec
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.config import EngineConfig
from cluster.placement import worker_bundle
from cluster.serve.ingress import Ingress
from cluster.serve.replica import EngineReplica
from kvcore import encode
from workers.parallel import free_port

APP_NAME = "kvray"
ROUTER = "cluster.serve.router:KVRayRouter"
# How often each replica publishes what its cache holds; the router also remembers what it
# routed in between.
ROUTING_STATS_PERIOD_S = 0.5
HEALTH_CHECK_PERIOD_S = 2.0
# Autoscaling: Serve averages the requests in flight over the look-back window, and adds
# (removes) a replica once that average has stayed above (below) the target this long.
AUTOSCALE_LOOK_BACK_S = 15.0  # more than the 10 s at which Serve samples by default
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 2.0, 10.0
QUIET = {"enable_access_log": False}  # one log line per request and replica is too many


HEAD_NODE = "node:__internal_head__"  # a resource only Ray's head node has


def application(args: dict):
    """The application a Serve config (a RayService's ``serveConfigV2``) builds: ``args``
    holds ``kvray serve`` settings by flag name, e.g. ``{model: /models/model,
    tensor-parallel-size: 2, autoscale: "1:4", port: 50051}``; the ingress runs on the head."""
    from cluster.cli.flags import config_of_settings

    return build_application(config_of_settings(args or {}), ingress_node=HEAD_NODE)


def build_application(config: EngineConfig, *, ingress_node: str | None = None):
    """The application of ``config``: its ingress (on the node that has the ``ingress_node``
    resource, e.g. ``node:<ip>``; None: any) bound to its engine replicas."""
    if config.use_gpu is None:
        config = msgspec.structs.replace(config, use_gpu=ray.cluster_resources().get("GPU", 0) > 0)
    replicas = serve.deployment(EngineReplica, name="EngineReplica", **replica_options(config))
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        ray_actor_options={
            "num_cpus": 0,
            "resources": {} if ingress_node is None else {ingress_node: 0.001},
        },
        max_ongoing_requests=1 << 20,  # it only forwards; the replicas' queues bound the work
        logging_config=QUIET,
    )
    return ingress.bind(replicas.bind(encode(config)), encode(config))


def replica_options(config: EngineConfig) -> dict:
    """The engine replicas' deployment options."""
    bundle = worker_bundle(bool(config.use_gpu), config.cpus_per_worker or 1)
    options = dict(
        ray_actor_options={"num_cpus": 0},
        placement_group_bundles=[bundle] * config.tensor_parallel_size,
        placement_group_strategy=config.placement_strategy,
        # A replica's own limits refuse beyond this (its queue), with a clear error.
        max_ongoing_requests=config.max_num_seqs + config.max_queue_len,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        # A replica Serve stops (scaling down, an update) first finishes what it runs.
        graceful_shutdown_timeout_s=config.drain_timeout_s,
        logging_config=QUIET,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER,
            request_router_kwargs={"policy": config.routing_policy},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )
    if config.replica_range is None:
        return {**options, "num_replicas": config.data_parallel_size}
    low, high = config.replica_range
    autoscaling = dict(
        min_replicas=low,
        max_replicas=high,
        target_ongoing_requests=config.target_ongoing_requests,
        look_back_period_s=AUTOSCALE_LOOK_BACK_S,
        upscale_delay_s=UPSCALE_DELAY_S,
        downscale_delay_s=DOWNSCALE_DELAY_S,
    )
    return {**options, "autoscaling_config": autoscaling}


def start_replicas(config: EngineConfig) -> tuple[object, str | None]:
    """Serve started on this Ray cluster with its HTTP proxy on ``--host:--http-port`` (none
    with ``--http-port off``; 0 picks a free port), and the application running; returns the
    ingress's handle and the HTTP API's address."""
    if config.http_port is None:
        http_address, http_options = None, {"location": "NoServer"}
    else:
        port = config.http_port or free_port(config.host)
        http_address, http_options = f"{config.host}:{port}", {"host": config.host, "port": port}
    serve.start(http_options=http_options)
    # Clients reach the gRPC API where they started kvray serve, as with one engine.
    here = f"node:{ray.util.get_node_ip_address()}"
    application = build_application(config, ingress_node=here)
    return serve.run(application, name=APP_NAME, route_prefix="/"), http_address


def stop_replicas() -> None:
    serve.delete(APP_NAME)
