"""One engine replica of the Serve deployment: an engine (scheduler, KV-cache coordinator,
step loop) over its own worker group, one worker actor per TP rank in the placement group
Serve reserved for the replica (its bundles: one per rank; the replica actor itself takes no
CPU). It takes requests already checked and tokenized by the ingress (``AdmittedRequest``)
and streams their outputs back.

A lost worker ends the replica instead of being rebuilt in place: its requests fail with
UNAVAILABLE, its health check fails, and Serve replaces the whole replica (a new placement
group and a fresh cache) while the other replicas keep serving. Every few tenths of a second
it reports to the routers what its cache holds (``routing_stats``)."""

from __future__ import annotations

import asyncio
import logging

from ray.util.placement_group import get_current_placement_group

from cluster.admission import AdmittedRequest
from cluster.assembly import build_engine
from cluster.config import EngineConfig
from cluster.engine import EngineState
from cluster.placement import start_worker_actors
from cluster.serve.routing import BOUNDARY, PREFIX, short_hash
from cluster.server_info import occupancy
from cluster.startup import check_expert_split, plan_kv_cache
from cluster.transport import ray_transport
from kvcore import FullAttentionSpec, decode, encode
from kvcore.hashing import split_group_key
from workers.bringup import ActorRank, bring_up
from workers.model_source import model_config_for

logger = logging.getLogger(__name__)


class EngineReplica:
    async def __init__(self, config_bytes: bytes):
        config = decode(config_bytes, EngineConfig)  # use_gpu resolved by the application
        self.config = config.for_workers_on(use_gpu=bool(config.use_gpu))
        self.model_config = model_config_for(config.model)
        check_expert_split(self.model_config, self.config)
        self.workers = start_worker_actors(
            self.config, get_current_placement_group(), bool(config.use_gpu),
            self.config.cpus_per_worker or 1,
        )  # fmt: skip
        self.kv_config = await bring_up(
            [ActorRank(worker) for worker in self.workers],
            lambda reports: plan_kv_cache(reports, self.model_config, self.config),
        )
        # No rebuild: a lost worker stops this engine, and Serve replaces the replica.
        self.transport = ray_transport(self.config.step_transport, self.workers)
        self.engine = build_engine(self.config, self.model_config, self.kv_config, self.transport)
        self.engine.start()
        self.plan = encode(self.kv_config)  # reported with every routing stats, made once

    async def generate(self, payload: bytes):
        """The outputs of one request (an encoded ``AdmittedRequest``), as they come."""
        request = decode(payload, AdmittedRequest)
        engine_request = await self.engine.prepare(
            request.token_ids, request.sampling, request.request_id, cache_salt=request.cache_salt
        )
        async for output in self.engine.generate(engine_request):
            yield output

    async def ready(self) -> bool:
        return self.engine.is_serving

    async def worker_actors(self) -> list:
        """This replica's worker actors, one per TP rank (for operators and tests)."""
        return list(self.workers)

    def check_health(self) -> None:
        """Serve replaces a replica whose engine stopped serving for good."""
        if self.engine.state is EngineState.DEAD:
            raise RuntimeError(f"the engine stopped serving: {self.engine.state_reason}")

    def record_routing_stats(self) -> dict:
        return routing_stats(self.engine, self.kv_config, self.plan)

    async def __del__(self) -> None:
        await self.engine.stop()
        # A compiled graph's teardown blocks on its ranks: off the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self.transport.close)


def routing_stats(engine, kv_config, plan: bytes) -> dict:
    """What the routers read of this replica: per KV-cache group, the (short) hashes of the
    blocks its prefix cache holds and how they make a hit; whether it serves; its occupancy
    and counters; its metrics; and its plan (for GetServerInfo)."""
    coordinator = engine.scheduler.coordinator
    hashes = [set() for _ in kv_config.kv_cache_groups]
    for key, _ in coordinator.block_pool.cached_blocks.iter_blocks():
        block_hash, group_id = split_group_key(key)
        hashes[group_id].add(short_hash(block_hash))
    groups = []
    for group, cached in zip(kv_config.kv_cache_groups, hashes, strict=True):
        spec = group.kv_cache_spec
        groups.append(
            {
                "units": spec.block_size // kv_config.hash_block_size,
                # A full-attention hit needs every block up to it; other groups keep what a
                # hit needs only at its end (a recurrent state, a window).
                "hit": PREFIX if isinstance(spec, FullAttentionSpec) else BOUNDARY,
                "hashes": sorted(cached),
            }
        )
    return {
        "serving": engine.is_serving,
        "hash_block_size": kv_config.hash_block_size,
        "groups": groups,
        "occupancy": occupancy(engine),
        "summary": engine.stats.summary(),
        "metrics": engine.metrics.render().decode() if engine.metrics is not None else "",
        "plan": plan,
    }
