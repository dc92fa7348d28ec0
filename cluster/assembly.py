"""Putting a serving engine together once the workers hold their caches: coordinator,
scheduler, engine, gRPC server. Shared by the Ray controller and the in-process server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cluster.config import EngineConfig
from cluster.engine import AsyncEngine, Rebuild
from cluster.http import start_http_server
from cluster.http.server import HttpServer
from cluster.metrics import EngineMetrics
from cluster.scheduler.scheduler import Scheduler, SchedulerConfig
from cluster.server import ApiServer
from cluster.server_info import server_info, static_info
from cluster.speculative.ngram import NgramProposer
from kvcore import KVCacheConfig
from kvcore.coordinator import KVCacheCoordinator
from workers.model_config import ModelConfig
from workers.model_source import load_tokenizer_for, model_display_name


def build_scheduler(
    config: EngineConfig, model_config: ModelConfig, kv_config: KVCacheConfig
) -> Scheduler:
    """A scheduler and coordinator for a freshly allocated cache of ``kv_config``."""
    coordinator = KVCacheCoordinator.from_config(
        kv_config,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_caching=config.enable_prefix_caching,
    )
    return Scheduler(
        coordinator,
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=kv_config.max_model_len,
            eos_token_ids=model_config.eos_token_ids,
            micro_batches=config.micro_batches,
        ),
        proposer=speculative_proposer(config),
    )


def speculative_proposer(config: EngineConfig) -> NgramProposer | None:
    """The drafts --speculative-config asks for (None: off). A hybrid's Mamba layers undo a
    rejected draft from the draft states their specs keep (``workers.kinds.mamba``)."""
    speculative = config.speculative
    return None if speculative is None else NgramProposer(speculative)


def build_engine(
    config: EngineConfig,
    model_config: ModelConfig,
    kv_config: KVCacheConfig,
    transport,
    rebuild: Rebuild | None = None,
) -> AsyncEngine:
    """The engine over a started worker group; ``rebuild`` replaces the group after a
    failure (without it, a lost worker stops the engine)."""
    tokenizer = load_tokenizer_for(config.model, model_config.eos_token_ids)
    engine = AsyncEngine(
        build_scheduler(config, model_config, kv_config),
        transport,
        tokenizer,
        vocab_size=model_config.vocab_size,
        max_model_len=kv_config.max_model_len,
        max_queue_len=config.max_queue_len,
        rebuild=rebuild,
        max_rebuild_attempts=config.max_rebuild_attempts,
    )
    engine.admission.default_sampling = dict(model_config.default_sampling or {})
    engine.set_metrics(EngineMetrics(served_model_name(config)))
    return engine


def served_model_name(config: EngineConfig) -> str:
    """The model's name in the APIs: --served-model-name, else the --model path or name."""
    return config.served_model_name or model_display_name(config.model)


def connect_health(engine: AsyncEngine, server: ApiServer) -> None:
    """gRPC health follows whether the engine takes requests."""
    engine.on_serving_change = lambda serving: asyncio.ensure_future(server.set_serving(serving))


def build_server(config: EngineConfig, engine: AsyncEngine, kv_config: KVCacheConfig) -> ApiServer:
    info = static_info(
        served_model_name(config),
        (config.tensor_parallel_size, config.pipeline_parallel_size),
        config.attention_backend,
        kv_config,
        engine.vocab_size,
    )
    return ApiServer(
        engine,
        lambda: server_info(engine, info),
        host=config.host,
        port=config.port,
        api_key=config.api_key,
        max_request_bytes=config.max_request_body_bytes,
    )


@dataclass
class Serving:
    """An engine with its front ends: gRPC always, the HTTP API when configured."""

    engine: AsyncEngine
    grpc: ApiServer
    http: HttpServer | None

    async def stop(self, grace: float = 1.0) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace)
        await self.engine.stop()


async def start_serving(
    config: EngineConfig,
    model_config: ModelConfig,
    kv_config: KVCacheConfig,
    transport,
    rebuild: Rebuild | None = None,
) -> Serving:
    """Build the engine over a started worker group, start its loop and its front ends."""
    engine = build_engine(config, model_config, kv_config, transport, rebuild)
    grpc_server = build_server(config, engine, kv_config)
    connect_health(engine, grpc_server)
    engine.start()
    await grpc_server.start()
    http = await start_http_server(
        config, engine, kv_config.max_model_len, served_model_name(config)
    )
    return Serving(engine, grpc_server, http)
