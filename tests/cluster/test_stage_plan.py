"""``kvray plan --pipeline-parallel-size``: each stage plans the cache of its own layers, and
the stages share the blocks of the one that fits the fewest."""

from __future__ import annotations

import subprocess
import sys

from cluster.config import EngineConfig
from cluster.stage_plan_report import stage_plan_report
from tests.workers.hf_models import save_nemotron_h
from workers.model_source import model_config_for
from workers.stages import PARTITION_ENV

SIZES = dict(kv_cache_memory_bytes=1 << 20, max_model_len=128, block_size=4)


def report(model_dir, count: int) -> str:
    config = EngineConfig(model=str(model_dir), **SIZES)
    return stage_plan_report(config, model_config_for(str(model_dir)), count)


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


def test_the_stage_that_fits_the_fewest_blocks_sets_the_engines(tmp_path, monkeypatch):
    model_dir = save_nemotron_h(tmp_path, "M*-M*-", n_groups=2)
    monkeypatch.setenv(PARTITION_ENV, "2,1,3")  # the middle stage is one MLP layer
    lines = report(model_dir, 3).splitlines()
    stages = {line.split(":")[0]: line for line in lines if line.startswith("stage ")}
    assert stages["stage 1"] == "stage 1: layer 2; no cache (none of its layers keeps state)"
    blocks = {
        name: int(line.rsplit("; ", 1)[1].split(" blocks")[0])
        for name, line in stages.items()
        if name != "stage 1"
    }
    fewest = min(blocks, key=blocks.get)
    assert f"blocks: {blocks[fewest]}, one block table for every stage ({fewest} fits" in lines[2]


def test_more_stages_than_layers_are_refused_by_name():
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "plan", "-pp", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "--pipeline-parallel-size 5 asks for more stages than the model has decoder layers (4)"
        in (result.stderr)
    )
