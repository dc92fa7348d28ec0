"""Running kvray's Serve application in tests: one Serve instance per Ray cluster, an
application (re)deployed per configuration on fresh ports, and what the tests read off it."""

from __future__ import annotations

import time

from ray import serve

from cluster.client import Client
from cluster.config import EngineConfig
from cluster.serve.app import APP_NAME, build_application
from workers.parallel import free_port


def start_serve() -> int:
    """Serve on this Ray cluster; returns its HTTP port."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def deploy(http_port: int, **settings) -> str:
    """The application of ``settings`` (replacing any earlier one); returns its gRPC
    address once every replica has reported."""
    config = EngineConfig(
        **{"cpus_per_worker": 1, "port": free_port(), "http_port": http_port, **settings}
    )
    expected = config.replica_range[0] if config.replica_range else config.data_parallel_size
    return run_application(build_application(config), expected)


def run_application(application, expected_replicas: int) -> str:
    """Runs ``application`` (replacing any earlier one); returns its gRPC address once
    ``expected_replicas`` replicas have reported."""
    ingress = serve.run(application, name=APP_NAME, route_prefix="/")
    address = ingress.grpc_address.remote().result()
    wait_for(
        lambda: replica_count(address) == expected_replicas,
        what=f"{expected_replicas} replicas reporting",
    )
    return address


def replica_count(address: str) -> int:
    try:
        with Client(address, timeout=10) as client:
            return len(client.info().get("replicas", []))
    except Exception:
        return 0


def replicas(address: str) -> dict[str, dict]:
    """Replica id -> its ReplicaInfo, as GetServerInfo reports it."""
    with Client(address, timeout=10) as client:
        return {r["replica_id"]: r for r in client.info().get("replicas", [])}


def wait_for(condition, *, what: str, timeout: float = 120.0, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every)
