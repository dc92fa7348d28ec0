"""``kvray plan --pipeline-parallel-size N``: each pipeline stage's KV-cache plan, from the
model's config alone.

Every stage keeps the cache of its own layers, but a request's block ids are the same on
every stage (the scheduler keeps one block table), so the engine has the blocks of the stage
that fits the fewest in its memory: that stage's capacity is the engine's."""

from __future__ import annotations

from cluster.config import EngineConfig
from cluster.plan_report import chosen_layout, group_lines, rank_specs
from cluster.stage_startup import check_stage_plans
from cluster.startup import plan_options
from kvcore import KVCacheConfig, get_kv_cache_config
from workers.model_config import ModelConfig
from workers.model_source import model_display_name
from workers.stages import PipelineStage


def stage_plan_report(config: EngineConfig, model_config: ModelConfig) -> str:
    stages = config.pipeline_stages(model_config.num_hidden_layers)
    memory = config.kv_cache_memory_bytes or 0
    options = plan_options(config, model_config)
    layout = chosen_layout(config, rank_specs(config, model_config))
    plans: list[KVCacheConfig | None] = []
    for stage in stages:
        specs = rank_specs(config, model_config, stage.layers)
        plans.append(get_kv_cache_config(specs, memory, layout, **options) if specs else None)
    check_stage_plans(plans, stages)
    limiting, limit = min(
        zip(stages, plans, strict=True), key=lambda planned: planned[1].num_blocks
    )
    lines = [
        f"model: {model_display_name(config.model)} ({model_config.architecture}), "
        f"PP {len(stages)} x TP {config.tensor_parallel_size}, "
        f"{model_config.num_hidden_layers} layers",
        f"layout: {limit.layout}; KV memory per rank: {memory} bytes",
        f"blocks: {limit.num_blocks}, one block table for every stage (stage {limiting.index} "
        "fits the fewest)",
        f"fits: {limit.capacity_tokens} tokens, max concurrency {limit.max_concurrency:.2f}x at "
        f"{limit.max_model_len} tokens",
    ]
    for stage, kv in zip(stages, plans, strict=True):
        lines.append(stage_line(stage, kv))
        lines.extend(group_lines(kv, indent="    "))
    return "\n".join(lines)


def stage_line(stage: PipelineStage, kv: KVCacheConfig) -> str:
    held = [
        f"layers {stage.start}-{stage.end - 1}" if len(stage.layers) > 1 else f"layer {stage.start}"
    ]
    if stage.is_first:
        held.append("the embedding")
    if stage.is_last:
        held.append("the final norm, LM head and sampling")
    cache = f"{kv.num_blocks} blocks x {kv.bytes_per_block} bytes"
    return f"stage {stage.index}: {', '.join(held)}; {cache}"
