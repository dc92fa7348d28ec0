"""The controller: a Ray actor that reserves a placement group, starts one worker actor per TP
rank, runs the startup handshake, and then hosts the engine loop and the gRPC server."""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.assembly import build_scheduler, start_serving
from cluster.config import EngineConfig
from cluster.placement import cpus_per_worker, reserve, start_worker_actors, worker_bundle
from cluster.scheduler.scheduler import Scheduler
from cluster.stage_startup import plan_stage_caches
from cluster.startup import check_expert_split, plan_kv_cache
from cluster.transport import StepTransport, ray_transport, staged_transport
from kvcore import KVCacheConfig, decode, encode
from workers.bringup import ActorRank, bring_up, bring_up_stages
from workers.model_source import model_config_for

logger = logging.getLogger(__name__)


class Controller:
    def __init__(self, config_bytes: bytes):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.config = decode(config_bytes, EngineConfig)
        self.model_config = model_config_for(self.config.model)
        self.workers: list = []
        self.pg = None
        self.transport: StepTransport | None = None
        self.use_gpu = False
        self.cpus_per_worker = 1
        self.stages = None  # the pipeline stages, when there are several
        self.engine = None
        self.serving = None  # the engine and its front ends, once started

    async def start(self) -> dict:
        """Place and start the workers, agree on the KV plan, start serving; returns the
        server address and the plan's headline figures."""
        if self.config.use_gpu is None:
            self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        else:
            self.use_gpu = self.config.use_gpu
        self.config = self.config.for_workers_on(use_gpu=self.use_gpu)
        check_expert_split(self.model_config, self.config)
        # A split that cannot be made is refused before anything is placed.
        self.stages = self.config.pipeline_stages(self.model_config.num_hidden_layers)
        transport, kv_config = await self._start_group()
        self.serving = await start_serving(
            self.config, self.model_config, kv_config, transport, rebuild=self._rebuild
        )
        self.engine = self.serving.engine
        http = self.serving.http
        return {
            "address": self.serving.grpc.address,
            "http_address": None if http is None else http.address,
            "num_blocks": kv_config.num_blocks,
            "capacity_tokens": kv_config.capacity_tokens,
            "max_concurrency": kv_config.max_concurrency,
            "layout": kv_config.layout,
        }

    async def _start_group(self) -> tuple[StepTransport, KVCacheConfig]:
        """Placement group, one worker actor per rank, handshake, allocated caches."""
        await self._reserve(self.use_gpu)
        self.workers = start_worker_actors(
            self.config, self.pg, self.use_gpu, self.cpus_per_worker, self.stages
        )
        if self.stages is not None:
            return await self._start_stages(self.stages)
        kv_config = await bring_up(
            [ActorRank(worker) for worker in self.workers],
            lambda reports: plan_kv_cache(reports, self.model_config, self.config),
        )
        self.transport = ray_transport(self.config.step_transport, self.workers)
        return self.transport, kv_config

    async def _start_stages(self, stages: list) -> tuple[StepTransport, KVCacheConfig]:
        """The stages' handshake (every stage planned with the same blocks); the scheduler
        plans with the first stage's groups, which every stage's line up with."""
        tp = self.config.tensor_parallel_size
        actors = [self.workers[i : i + tp] for i in range(0, len(self.workers), tp)]
        plans = await bring_up_stages(
            [[ActorRank(worker) for worker in stage] for stage in actors],
            lambda reports: plan_stage_caches(reports, self.model_config, self.config, stages),
        )
        self.transport = staged_transport(self.config.step_transport, actors)
        return self.transport, plans[0]

    async def _rebuild(self) -> tuple[StepTransport, Scheduler]:
        """After a failure: a new worker group with a fresh cache, and its scheduler. Every
        rank goes, the healthy ones too: a TP group with a dead member cannot be mended."""
        await self._tear_down_group()
        transport, kv_config = await self._start_group()
        return transport, build_scheduler(self.config, self.model_config, kv_config)

    async def _tear_down_group(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.workers, self.pg = [], None
        transport, self.transport = self.transport, None
        if transport is not None:
            # A compiled graph's teardown blocks on its ranks (dead by now, so it is quick):
            # off the event loop, which is still telling clients their streams failed.
            await asyncio.get_running_loop().run_in_executor(None, transport.close)

    async def _reserve(self, use_gpu: bool) -> None:
        self.cpus_per_worker = cpus_per_worker(self.config, use_gpu)
        self.pg = await reserve(self.config, worker_bundle(use_gpu, self.cpus_per_worker))

    async def worker_handles(self) -> list:
        return list(self.workers)

    async def worker_node_ids(self) -> list[str]:
        return list(await asyncio.gather(*(w.node_id.remote() for w in self.workers)))

    async def stats(self) -> dict:
        """Counters tests and operators read: free blocks, preemptions, steps, rebuilds."""
        scheduler = self.engine.scheduler
        return {
            "num_free_blocks": scheduler.coordinator.num_free_blocks,
            "num_usable_blocks": scheduler.coordinator.block_pool.num_blocks - 1,  # not null
            "num_preemptions": scheduler.num_preemptions,
            "num_steps": self.engine.num_steps,
            "num_rebuilds": self.engine.num_rebuilds,
            "most_steps_in_flight": self.engine.most_steps_in_flight,
            "state": self.engine.state.value,
            "step_transport": type(self.transport).__name__,
        }

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def drain(self, timeout: float) -> int:
        """Stop taking requests (health NOT_SERVING), let in-flight ones finish for up to
        ``timeout`` seconds, abort the rest; returns how many were aborted."""
        aborted = await self.engine.drain(timeout)
        logger.info("Drained: %d request(s) aborted at the deadline", aborted)
        return aborted

    async def stop(self) -> None:
        if self.serving is not None:
            await self.serving.stop(1.0)
        await self._tear_down_group()


def start_controller(config: EngineConfig):
    """Create the controller actor on this process's node, where users, the manifests'
    Service and the readiness probe look for the gRPC server (it reserves no CPU, so without
    the pin Ray could place it on any node, a GPU worker's included)."""
    here = ray.get_runtime_context().get_node_id()
    actor_class = ray.remote(num_cpus=0)(Controller)
    handle = actor_class.options(
        max_concurrency=1000,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(encode(config))
    return handle, ray.get(handle.start.remote())
