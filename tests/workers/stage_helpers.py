"""What the pipeline-stage tests share: tiny checkpoints of every family split in two, both
stages' workers started as an engine starts its ranks, and two ways to drive them."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.workers.engine import KV_CACHE_MEMORY, start_worker
from tests.workers.harness import StepDriver
from tests.workers.hf_models import save_deepseek, save_model, save_nemotron_h
from workers.loader import load_weights
from workers.model_source import model_config_for
from workers.models.registry import model_class_for
from workers.options import WorkerOptions
from workers.stages import split_layers


def save_stage_checkpoint(name: str, directory: Path) -> tuple[Path, str, int]:
    """(model dir, layout, prefill chunk) for ``name``: a dense Llama ("llama"), one with its
    head tied to the embedding ("llama-tied"), a NemotronH with Mamba, attention and MLP layers
    on both stages ("nemotron-h"), or a dense DeepSeek with MLA ("deepseek")."""
    if name in ("llama", "llama-tied"):
        return save_model(name, directory), "LHBNC", 5
    if name == "nemotron-h":
        return save_nemotron_h(directory, "M*-M*-", n_groups=2), "BLHNC", 6
    return save_deepseek(directory, q_lora_rank=None), "BLHNC", 6


def build(model_dir, stage=None):
    config = model_config_for(str(model_dir))
    model = model_class_for(config)(config, torch.float32, stage)
    load_weights(model, model_dir, show_progress=False)
    return model


def stage_workers(model_dir, layout: str, **extra) -> list:
    """Both stages' workers, started as an engine starts its ranks. Mamba states are kept
    every 8 tokens, so that a prefix hit has a state to resume from."""
    config = model_config_for(str(model_dir))
    options = [
        WorkerOptions(
            model=str(model_dir),
            block_size=4,
            attention_backend="torch",
            kv_cache_memory_bytes=KV_CACHE_MEMORY,
            enable_prefix_caching=True,
            mamba_state_interval=8,
            max_num_batched_tokens=256,
            pipeline_stage=stage,
            **extra,
        )
        for stage in split_layers(config.num_hidden_layers, 2)
    ]
    return [start_worker(o, layout) for o in options]


def chained(first, last) -> StepDriver:
    """A driver of both stages as one engine: each plan runs through the first stage, whose
    hidden states the last takes; the first then learns the tokens the last sampled."""
    plans = [first.runner.config, last.runner.config]
    # The stages share one block table: their groups line up, and the plan fits the smaller.
    assert [g.kv_cache_spec.block_size for g in plans[0].kv_cache_groups] == [
        g.kv_cache_spec.block_size for g in plans[1].kv_cache_groups
    ]

    def execute(plan):
        result = last.runner.execute(plan, first.runner.run_stage(plan))
        first.runner.take_sampled(plan, result)
        return result

    return StepDriver(min(plans, key=lambda c: c.num_blocks), execute)


def planned_layers(worker) -> list[str]:
    return [name for group in worker.runner.config.kv_cache_groups for name in group.layer_names]
