"""An engine and its gRPC server in this process, with one in-process worker (TP=1, no Ray).

For tests and quick experiments; ``kvray serve`` runs the same parts inside a Ray controller.
The server's event loop runs in a background thread, so synchronous code can use the client.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from cluster.assembly import build_scheduler, start_serving
from cluster.config import EngineConfig
from cluster.scheduler.scheduler import Scheduler
from cluster.startup import plan_kv_cache
from cluster.transport import InProcessTransport, step_thread
from kvcore import KVCacheConfig
from workers.bringup import bring_up_in_process
from workers.worker import Worker


class LocalServer:
    def __init__(self, config: EngineConfig):
        if config.world_size != 1:
            raise ValueError(
                "The in-process server runs one rank (TP 1, one pipeline stage); use kvray "
                "serve for more ranks."
            )
        self.config = config.for_workers_on(use_gpu=torch.cuda.is_available())
        # The worker is built (weights loaded, memory profiled) on the thread it steps on.
        self._step_thread = step_thread()
        self.worker, self.kv_config = self._step_thread.submit(self._start_worker).result()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvray-local", daemon=True)
        self.engine = None
        self.server = None
        self.http = None  # the HTTP API, when config.http_port is set

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    def _start_worker(self) -> tuple[Worker, KVCacheConfig]:
        worker = Worker(0, self.config.worker_options())
        kv_config = bring_up_in_process(
            worker, lambda reports: plan_kv_cache(reports, worker.model_config, self.config)
        )
        return worker, kv_config

    async def _rebuild(self) -> tuple[InProcessTransport, Scheduler]:
        """A fresh worker and cache after a failed step, as the Ray controller does."""
        self.worker.shutdown()
        loop = asyncio.get_running_loop()
        self.worker, self.kv_config = await loop.run_in_executor(
            self._step_thread, self._start_worker
        )
        scheduler = build_scheduler(self.config, self.worker.model_config, self.kv_config)
        return InProcessTransport(self.worker, self._step_thread), scheduler

    async def _start(self) -> None:
        self.serving = await start_serving(
            self.config,
            self.worker.model_config,
            self.kv_config,
            InProcessTransport(self.worker, self._step_thread),
            rebuild=self._rebuild,
        )
        self.engine, self.server, self.http = (
            self.serving.engine,
            self.serving.grpc,
            self.serving.http,
        )

    def start(self) -> LocalServer:
        self._thread.start()
        self._ready.wait(timeout=60)
        return self

    @property
    def address(self) -> str:
        return self.server.address

    def run(self, coroutine):
        """Run ``coroutine`` on the server's loop (to inspect the engine safely)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=60)

    def stop(self) -> None:
        self.run(self.serving.stop(0.5))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.worker.shutdown()
        self._step_thread.shutdown(wait=False)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
