"""``kvray plan --pipeline-parallel-size``: each stage plans the cache of its own layers, and
the stages share the blocks of the one that fits the fewest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.config import EngineConfig
from cluster.stage_plan_report import stage_plan_report
from tests.workers.hf_models import save_nemotron_h
from workers.model_source import model_config_for
from workers.stages import StagePartitionError

SIZES = dict(kv_cache_memory_bytes=1 << 20, max_model_len=128, block_size=4)


def report(model_dir, count: int, partition: str | None = None) -> str:
    config = EngineConfig(
        model=str(model_dir), pipeline_parallel_size=count, pp_layer_partition=partition, **SIZES
    )
    return stage_plan_report(config, model_config_for(str(model_dir)))


def test_a_hybrid_plans_each_stage_with_its_own_mamba_and_attention_layers(tmp_path):
    model_dir = save_nemotron_h(tmp_path, "M*-M*-", n_groups=2)
    lines = report(model_dir, 2).splitlines()
    assert "NemotronHForCausalLM), PP 2 x TP 1, 6 layers" in lines[0]
    stages = [line for line in lines if line.startswith("stage ")]
    assert stages[0].startswith("stage 0: layers 0-2, the embedding; ")
    assert stages[1].startswith("stage 1: layers 3-5, the final norm, LM head and sampling; ")
    # One Mamba and one attention layer on each stage: two groups of one layer each.
    assert sum("MambaSpec: 1 layers" in line for line in lines) == 2
    assert sum("FullAttentionSpec: 1 layers" in line for line in lines) == 2


def test_the_stage_that_fits_the_fewest_blocks_sets_the_engines(tmp_path):
    model_dir = save_nemotron_h(tmp_path, "M*M*-M*", n_groups=2)
    # Stage 0: a Mamba and an attention layer; stage 1: two of each, twice the bytes a block.
    lines = report(model_dir, 2, partition="2,5").splitlines()
    stages = [line for line in lines if line.startswith("stage ")]
    blocks = [int(line.rsplit("; ", 1)[1].split(" blocks")[0]) for line in stages]
    assert blocks[1] < blocks[0]
    assert f"blocks: {blocks[1]}, one block table for every stage (stage 1 fits" in lines[2]


def test_a_stage_without_a_cache_is_refused_as_serving_would(tmp_path):
    model_dir = save_nemotron_h(tmp_path, "M*-M*-", n_groups=2)
    with pytest.raises(StagePartitionError, match="stage 1 \\(layers 2-2\\) holds no layer"):
        report(model_dir, 3, partition="2,1,3")  # the middle stage is one MLP layer


def kvray_plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", "plan", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


def test_the_partition_comes_from_the_flag_or_the_environment():
    by_env = kvray_plan("-pp", "2", KVRAY_PP_LAYER_PARTITION="1,3")
    assert by_env.returncode == 0, by_env.stderr
    assert "stage 0: layer 0, the embedding; " in by_env.stdout
    by_flag = kvray_plan("-pp", "2", "--pp-layer-partition", "3,1")
    assert "stage 1: layer 3, the final norm, LM head and sampling; " in by_flag.stdout


def test_more_stages_than_layers_are_refused_by_name():
    result = kvray_plan("-pp", "5")
    assert result.returncode != 0
    assert (
        "--pipeline-parallel-size 5 asks for more stages than the model has decoder layers (4)"
        in (result.stderr)
    )
