"""The startup handshake, once every rank has reported: check that every rank's geometry
follows from the model config and TP size, resolve the layout, and plan the KV cache with
the smallest rank's memory, so every rank gets the same ``KVCacheConfig``."""

from __future__ import annotations

import logging

from cluster.config import EngineConfig
from kernels.attention import get_attention_backend
from kvcore import (
    KVCacheConfig,
    KVCacheSpec,
    RankReport,
    check_rank_reports,
    get_kv_cache_configs,
    resolve_kv_cache_layout,
)
from workers.kv_specs import global_kv_cache_specs, state_head_axes
from workers.model_config import ModelConfig

logger = logging.getLogger(__name__)


def max_model_len_for(config: EngineConfig, model_config: ModelConfig) -> int:
    return config.max_model_len or model_config.max_position_embeddings


def engine_global_specs(
    model_config: ModelConfig, config: EngineConfig, layers: range | None = None
) -> dict[str, KVCacheSpec]:
    """Every stateful layer's spec (of ``layers`` only, a pipeline stage's, when given) as
    this engine's settings make it, with the model's total heads."""
    return global_kv_cache_specs(
        model_config,
        config.block_size,
        config.cache_dtype(model_config.dtype),
        config.tensor_parallel_size,
        config.state_caching(),
        model_dtype=config.model_dtype(model_config.dtype),
        num_speculative_tokens=config.num_speculative_tokens,
        layers=layers,
    )


def check_reports(
    reports: list[RankReport],
    model_config: ModelConfig,
    config: EngineConfig,
    layers: range | None = None,
) -> None:
    """Every rank's geometry is the one the model config and TP size give it."""
    check_rank_reports(
        reports,
        engine_global_specs(model_config, config, layers),
        config.tensor_parallel_size,
        customize_spec=get_attention_backend(config.attention_backend).customize_spec,
        state_head_axes=state_head_axes(model_config),
    )


def plan_options(config: EngineConfig, model_config: ModelConfig) -> dict:
    return dict(
        max_model_len=max_model_len_for(config, model_config),
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        num_blocks_override=config.num_gpu_blocks_override,
    )


def plan_kv_cache(
    reports: list[RankReport], model_config: ModelConfig, config: EngineConfig
) -> KVCacheConfig:
    check_reports(reports, model_config, config)
    ordered = sorted(reports, key=lambda r: r.rank)
    layout = resolve_kv_cache_layout(
        config.kv_cache_layout,
        [r.supported_layouts for r in ordered],
        ordered[0].specs.values(),
    )
    max_model_len = max_model_len_for(config, model_config)
    configs = get_kv_cache_configs(
        [r.specs for r in ordered],
        [r.free_memory_bytes for r in ordered],
        layout,
        **plan_options(config, model_config),
    )
    plan = configs[0]
    logger.info(
        "KV cache: %d blocks of %d tokens, %d tokens, max concurrency %.2fx at %d tokens, "
        "layout %s, %d group(s)",
        plan.num_blocks,
        plan.scheduler_block_size,
        plan.capacity_tokens,
        plan.max_concurrency,
        max_model_len,
        plan.layout,
        len(plan.kv_cache_groups),
    )
    return plan


def check_expert_split(model_config: ModelConfig, config: EngineConfig) -> None:
    """A MoE model's experts must split over the TP group the way it is asked to (whole
    experts with --enable-expert-parallel, else every expert's rows): refused here, by name,
    before any worker is placed."""
    if model_config.moe is not None:
        tp = config.tensor_parallel_size
        for rank in range(tp):
            model_config.moe.placement(tp, rank, config.enable_expert_parallel)
