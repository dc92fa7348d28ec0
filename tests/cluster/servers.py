"""The same serving behaviour tests run against every way kvray serves: the in-process engine
(TP 1, no Ray), and the Ray controller at TP 1 and TP 2 on a real local Ray cluster."""

from __future__ import annotations

import ray

from cluster.config import EngineConfig
from cluster.controller import start_controller
from cluster.local import LocalServer


class InProcessServer:
    def __init__(self, config: EngineConfig):
        self._server = LocalServer(config).start()
        self.address = self._server.address

    def stats(self) -> dict:
        async def read():
            scheduler = self._server.engine.scheduler
            return {
                "num_free_blocks": scheduler.coordinator.num_free_blocks,
                "num_preemptions": scheduler.num_preemptions,
            }

        return self._server.run(read())

    def stop(self) -> None:
        self._server.stop()


class RayServer:
    def __init__(self, config: EngineConfig):
        self._handle, info = start_controller(config)
        self.address = info["address"]

    def stats(self) -> dict:
        return ray.get(self._handle.stats.remote())

    def stop(self) -> None:
        ray.get(self._handle.stop.remote())
        ray.kill(self._handle)


KINDS = {
    "in-process": (InProcessServer, 1),
    "ray-tp1": (RayServer, 1),
    "ray-tp2": (RayServer, 2),
}


def start_server(kind: str, **settings):
    server_class, tp = KINDS[kind]
    return server_class(EngineConfig(**settings, tensor_parallel_size=tp))
