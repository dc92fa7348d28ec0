"""The startup handshake of a pipeline-parallel engine, once every stage's ranks have reported.

Each stage is checked as a TP group is, against the specs of its own layers; one layout serves
every rank; and every stage is planned with the same number of blocks, the fewest any stage
fits, because a request's block ids are the same on every stage (the scheduler keeps one block
table). So the stages' cache groups must line up group for group (the same kind, block size
and page, whatever their number of layers): a split that leaves one stage with layers of a
kind the other lacks is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.config import EngineConfig
from cluster.startup import check_reports, plan_options
from kvcore import KVCacheConfig, RankReport, get_kv_cache_configs, resolve_kv_cache_layout
from workers.model_config import ModelConfig
from workers.stages import PARTITION, PipelineStage, StagePartitionError


def plan_stage_caches(
    reports_by_stage: Sequence[Sequence[RankReport]],
    model_config: ModelConfig,
    config: EngineConfig,
    stages: Sequence[PipelineStage],
) -> list[KVCacheConfig]:
    """Each stage's plan (every rank of a stage holds its stage's), in stage order."""
    ordered = [sorted(reports, key=lambda r: r.rank) for reports in reports_by_stage]
    for stage, reports in zip(stages, ordered, strict=True):
        check_reports(reports, model_config, config, stage.layers)
    layout = resolve_kv_cache_layout(
        config.kv_cache_layout,
        [r.supported_layouts for reports in ordered for r in reports],
        [spec for reports in ordered for spec in reports[0].specs.values()],
    )
    options = plan_options(config, model_config)

    def plan(reports: list[RankReport], **override) -> KVCacheConfig:
        specs = [r.specs for r in reports]
        memory = [r.free_memory_bytes for r in reports]
        return get_kv_cache_configs(specs, memory, layout, **(options | override))[0]

    plans = [plan(reports) if reports[0].specs else None for reports in ordered]
    check_stage_plans(plans, stages)
    fewest = min(p.num_blocks for p in plans)
    return [
        p if p.num_blocks == fewest else plan(reports, num_blocks_override=fewest)
        for p, reports in zip(plans, ordered, strict=True)
    ]


def check_stage_plans(
    plans: Sequence[KVCacheConfig | None], stages: Sequence[PipelineStage]
) -> None:
    """Every stage has a cache (None: its layers keep none), in groups that line up with
    stage 0's; refused by name otherwise (``kvray plan -pp`` refuses what serving would)."""
    for stage, plan in zip(stages, plans, strict=True):
        if plan is None:
            raise StagePartitionError(
                f"Pipeline stage {stage.index} (layers {stage.start}-{stage.end - 1}) holds no "
                f"layer that keeps a cache; choose a split ({PARTITION}) that gives every stage "
                "one."
            )
    first = [group.kv_cache_spec for group in plans[0].kv_cache_groups]
    for stage, plan in zip(stages[1:], plans[1:], strict=True):
        groups = [group.kv_cache_spec for group in plan.kv_cache_groups]
        if groups != first:
            raise StagePartitionError(
                f"Pipeline stage {stage.index} plans the cache groups {_names(groups)} where "
                f"stage 0 plans {_names(first)}: the stages share one block table, so each must "
                f"hold the same kinds of layers. Choose a split ({PARTITION}) whose stages do."
            )


def _names(specs) -> str:
    return "[" + ", ".join(type(spec).__name__ for spec in specs) + "]"
