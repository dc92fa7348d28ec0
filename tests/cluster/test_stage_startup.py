"""The startup handshake of pipeline stages, on workers in this process: each stage is a TP
group of its own and reports its own layers' specs; every stage gets the block count of the
stage that fits the fewest; a split whose stages hold different kinds of layers is refused by
name; and the stages brought up so generate transformers' tokens."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from cluster.config import EngineConfig
from cluster.stage_startup import plan_stage_caches
from tests.workers.hf_models import PROMPTS, reference_generations, save_model
from tests.workers.stage_helpers import chained
from tests.workers.test_pipeline_stages import NUM_TOKENS
from workers.bringup import LocalRank, bring_up_stages
from workers.model_source import model_config_for
from workers.options import WorkerOptions
from workers.stages import StagePartitionError, split_layers
from workers.worker import Worker

MEMORY = 1 << 20


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        block_size=4,
        kv_cache_memory_bytes=MEMORY,
        kv_cache_layout="BLHNC",
        enable_prefix_caching=False,
        max_model_len=128,
        attention_backend="torch",
    )


def bring_up(model_dir, stages, memories) -> tuple[list[Worker], list]:
    config = engine_config(model_dir)
    model_config = model_config_for(str(model_dir))
    options = [
        msgspec.structs.replace(
            WorkerOptions.of(config, pipeline_stage=stage), kv_cache_memory_bytes=memory
        )
        for stage, memory in zip(stages, memories, strict=True)
    ]
    workers = [Worker(0, o) for o in options]

    def plan(reports):
        return plan_stage_caches(reports, model_config, config, stages)

    # In one process the stages hand their hidden states on by function call (``chained``).
    ranks = [[LocalRank(w)] for w in workers]
    plans = asyncio.run(bring_up_stages(ranks, plan, linked=False))
    return workers, plans


def test_every_stage_gets_the_blocks_of_the_one_that_fits_the_fewest(tmp_path):
    model_dir = save_model("llama", tmp_path)
    stages = split_layers(4, 2)
    # The last stage has half the memory of the first: its block count is the engine's.
    workers, plans = bring_up(model_dir, stages, [MEMORY, MEMORY // 2])
    alone = bring_up(model_dir, stages, [MEMORY // 2, MEMORY // 2])[1]
    assert plans[0].num_blocks == plans[1].num_blocks == alone[1].num_blocks
    assert [w.runner.config.num_blocks for w in workers] == [plans[0].num_blocks] * 2
    expected = reference_generations(model_dir, PROMPTS, NUM_TOKENS)
    requests = [(f"r{i}", p, NUM_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = chained(*workers).generate(requests, chunk=7)
    assert outputs == {f"r{i}": tokens for i, tokens in enumerate(expected)}


def test_stages_holding_different_kinds_of_layers_are_refused_by_name(tmp_path):
    model_dir = save_model("qwen3-sliding", tmp_path)  # full, sliding, full, sliding
    stages = split_layers(4, 2, "1,3")  # stage 0: one full-attention layer only
    with pytest.raises(StagePartitionError, match="Pipeline stage 1 plans the cache groups"):
        bring_up(model_dir, stages, [MEMORY, MEMORY])


def test_a_stage_whose_report_is_not_its_layers_is_refused(tmp_path):
    """Each stage is checked against the specs of its own layers: a rank of stage 1 that
    reports the whole model's is caught before any cache is allocated."""
    from kvcore import GeometryMismatchError, RankReport, decode

    model_dir = save_model("llama", tmp_path)
    stages = split_layers(4, 2)
    config = engine_config(model_dir)
    model_config = model_config_for(str(model_dir))
    reports = []
    for stage in (stages[0], None):  # the second rank forgot its stage
        worker = Worker(0, WorkerOptions.of(config, pipeline_stage=stage))
        worker.init_tp_group(None)
        worker.load_model()
        reports.append([decode(worker.report_specs(), RankReport)])
    with pytest.raises(GeometryMismatchError):
        plan_stage_caches(reports, model_config, config, stages)
