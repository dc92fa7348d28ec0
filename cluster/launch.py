"""Starting an engine for one command's use, and stopping it after: on Ray (the path
``kvray serve`` takes; the default), or in this process (TP 1, no Ray: quicker to start).
``kvray generate``, ``kvray batch`` and ``kvray bench`` all start theirs here."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.config import EngineConfig


@contextmanager
def running_engine(config: EngineConfig, *, in_process: bool = False) -> Iterator[str]:
    """Yields the gRPC address of an engine started with ``config``."""
    if in_process:
        from cluster.local import LocalServer

        with LocalServer(config) as server:
            yield server.address
        return
    import ray

    from cluster.controller import start_controller
    from workers.model_source import model_config_for

    model_config_for(config.model)  # a missing or unsupported model fails before Ray starts

    # The engine's own logs would interleave with the command's output; keep them off stdout.
    # A cluster started here lives for this command only: no dashboard, whose processes would
    # take CPU from the engine (a running cluster is joined as it is).
    ray.init(
        address=os.environ.get("RAY_ADDRESS") or None,
        log_to_driver=False,
        logging_level=logging.WARNING,
        include_dashboard=False,
    )
    handle, info = start_controller(config)
    try:
        yield info["address"]
    finally:
        ray.get(handle.stop.remote())
        ray.shutdown()
