"""Putting a serving engine together once the workers hold their caches: coordinator,
scheduler, engine, gRPC server. Shared by the Ray controller and the in-process server."""

from __future__ import annotations

import asyncio

from cluster.config import EngineConfig
from cluster.engine import AsyncEngine, Rebuild
from cluster.scheduler.scheduler import Scheduler, SchedulerConfig
from cluster.server import ApiServer
from cluster.server_info import static_info
from kvcore import KVCacheConfig
from kvcore.coordinator import KVCacheCoordinator
from workers.default_model import is_embedded, model_display_name
from workers.model_config import ModelConfig
from workers.tokenizer import load_tokenizer


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
        ),
    )


def build_engine(
    config: EngineConfig,
    model_config: ModelConfig,
    kv_config: KVCacheConfig,
    transport,
    rebuild: Rebuild | None = None,
) -> AsyncEngine:
    """The engine over a started worker group; ``rebuild`` replaces the group after a
    failure (without it, a lost worker stops the engine)."""
    model_dir = None if is_embedded(config.model) else config.model
    tokenizer = load_tokenizer(model_dir, model_config.eos_token_ids)
    return AsyncEngine(
        build_scheduler(config, model_config, kv_config),
        transport,
        tokenizer,
        vocab_size=model_config.vocab_size,
        max_model_len=kv_config.max_model_len,
        max_queue_len=config.max_queue_len,
        rebuild=rebuild,
        max_rebuild_attempts=config.max_rebuild_attempts,
    )


def connect_health(engine: AsyncEngine, server: ApiServer) -> None:
    """gRPC health follows whether the engine takes requests."""
    engine.on_serving_change = lambda serving: asyncio.ensure_future(server.set_serving(serving))


def build_server(config: EngineConfig, engine: AsyncEngine, kv_config: KVCacheConfig) -> ApiServer:
    info = static_info(
        model_display_name(config.model),
        config.tensor_parallel_size,
        config.attention_backend,
        kv_config,
        engine.vocab_size,
    )
    return ApiServer(engine, info, host=config.host, port=config.port, api_key=config.api_key)
