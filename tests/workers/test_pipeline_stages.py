"""Pipeline stages on the worker side: how the decoder layers are split, each stage built and
loaded with its own part of the checkpoint only, and two stages chained in this process (the
first's hidden states handed to the second) generating transformers' greedy tokens, with
chunked prefill, a preemption and a prefix hit. Between processes and nodes the hand-over is
the transport's; here it is a function call."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from kernels.attention import get_attention_backend
from kernels.quant.gguf_blocks import QuantizedMatrix
from tests.workers.hf_models import PROMPTS, reference_generations
from tests.workers.stage_helpers import build, chained, planned_layers, stage_workers
from workers.kv_cache import ALLOCATION_ALIGNMENT
from workers.kv_specs import rank_kv_cache_specs
from workers.model_source import model_config_for
from workers.profiling import run_profile_step
from workers.stages import StagePartitionError, split_layers

NUM_TOKENS = 12


def sizes(stages) -> list[int]:
    return [len(stage.layers) for stage in stages]


@pytest.mark.parametrize(
    ("num_layers", "count", "expected"),
    [(4, 2, [2, 2]), (5, 2, [3, 2]), (8, 3, [3, 3, 2]), (7, 4, [2, 2, 2, 1]), (3, 3, [1, 1, 1])],
)
def test_an_even_split_gives_the_layers_left_over_to_the_stages_before_the_last(
    num_layers, count, expected
):
    stages = split_layers(num_layers, count)
    assert sizes(stages) == expected
    assert stages[0].start == 0 and stages[-1].end == num_layers
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    assert [s.is_first for s in stages] == [True] + [False] * (count - 1)
    assert [s.is_last for s in stages] == [False] * (count - 1) + [True]


def test_a_partition_names_every_stage():
    assert sizes(split_layers(4, 2, "1, 3")) == [1, 3]
    assert sizes(split_layers(4, 2)) == [2, 2]


@pytest.mark.parametrize(
    ("num_layers", "count", "partition", "message"),
    [
        (3, 4, None, "asks for more stages than the model has decoder layers (3)"),
        (4, 0, None, "must be at least 1"),
        (4, 2, "2,1", "sums to 3 layers; the model has 4 decoder layers"),
        (4, 3, "2,2", "names 2 stage(s), but --pipeline-parallel-size is 3"),
        (4, 2, "4,0", "leaves a stage without layers"),
        (4, 2, "two,2", "is not a comma-separated list of layer counts"),
    ],
)
def test_a_split_that_cannot_be_made_is_refused_by_name(num_layers, count, partition, message):
    with pytest.raises(StagePartitionError, match=re.escape(message)):
        split_layers(num_layers, count, partition)


@pytest.mark.parametrize("name", ["llama", "llama-tied", "nemotron-h", "deepseek"])
def test_each_stage_holds_and_loads_only_its_part_of_the_model(checkpoints, name):
    model_dir, _, _ = checkpoints(name)
    whole = build(model_dir)
    expected = dict(whole.named_parameters())
    stages = split_layers(whole.config.num_hidden_layers, 2)
    seen, cache_layers = set(), []
    for stage in stages:
        model = build(model_dir, stage)
        params = dict(model.named_parameters())
        for param_name, param in params.items():
            assert torch.equal(param, expected[param_name]), param_name
        seen |= set(params)
        cache_layers += list(model.kv_cache_layers())
        assert (model.lm_head is not None) == stage.is_last
        held_layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert held_layers == set(stage.layers)
    assert seen == set(expected)  # every parameter on some stage
    assert sorted(cache_layers) == sorted(whole.kv_cache_layers())  # each cache layer once


@pytest.mark.parametrize("name", ["llama", "nemotron-h", "deepseek"])
def test_two_chained_stages_generate_the_tokens_of_transformers(checkpoints, name):
    model_dir, layout, chunk = checkpoints(name)
    first, last = stage_workers(model_dir, layout)
    # Each stage planned the cache of its own layers: together, the whole model's, once.
    names = planned_layers(first), planned_layers(last)
    assert not set(names[0]) & set(names[1])
    assert sorted(names[0] + names[1]) == sorted(build(model_dir).kv_cache_layers())
    driver = chained(first, last)
    expected = reference_generations(model_dir, PROMPTS, NUM_TOKENS)
    requests = [(f"r{i}", p, NUM_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = driver.generate(requests, chunk=chunk, preempt_after={"r1": 3})
    assert outputs == {f"r{i}": tokens for i, tokens in enumerate(expected)}
    # A later request whose prompt starts with r0's reads r0's blocks on both stages.
    hit_prompt = PROMPTS[0] + expected[0][:6]
    hit = {"hit": driver.prefix_hit("r0", hit_prompt)}
    assert hit["hit"][1] > 0
    again = driver.generate([("hit", hit_prompt, NUM_TOKENS)], chunk=chunk, prefix_from=hit)
    assert again["hit"] == reference_generations(model_dir, [hit_prompt], NUM_TOKENS)[0]


def test_the_stages_of_a_gguf_keep_their_own_blocks_and_generate_its_tokens(quantized_files):
    hf_dir, path = quantized_files["all"]
    first, last = stage_workers(path, "BLHNC", dtype="float32")
    for worker in (first, last):
        held = {
            name
            for name, module in worker.model.named_modules()
            if isinstance(getattr(module, "packed_weight", None), QuantizedMatrix)
        }
        stage = worker.options.pipeline_stage
        layers = {int(name.split(".")[2]) for name in held if name.startswith("model.layers.")}
        assert layers == set(stage.layers)
        assert ("lm_head" in held) == stage.is_last
    outputs = chained(first, last).generate(
        [(f"r{i}", p, NUM_TOKENS) for i, p in enumerate(PROMPTS[:2])], chunk=5
    )
    assert [outputs["r0"], outputs["r1"]] == reference_generations(hf_dir, PROMPTS[:2], NUM_TOKENS)


@pytest.mark.parametrize("name", ["llama", "nemotron-h"])
def test_each_stage_runs_the_profiling_step_alone(checkpoints, name):
    """A GPU worker sizes its cache after a full-size step of its own stage, before any other
    stage runs: the stages' scratch caches add up to the whole model's (each allocation is
    rounded up to ALLOCATION_ALIGNMENT bytes)."""
    model_dir, _, _ = checkpoints(name)
    backend = get_attention_backend("torch")

    def scratch_bytes(stage=None) -> int:
        model = build(model_dir, stage)
        specs = rank_kv_cache_specs(
            model.config, 4, 1, 0, layers=None if stage is None else stage.layers
        )
        sizes = dict(num_tokens=24, num_seqs=3, max_len=16, device=torch.device("cpu"))
        return run_profile_step(model, backend, specs, **sizes)

    stages = split_layers(model_config_for(str(model_dir)).num_hidden_layers, 2)
    parts, whole = [scratch_bytes(stage) for stage in stages], scratch_bytes()
    assert all(0 < part < whole for part in parts)
    assert whole <= sum(parts) <= whole + len(parts) * ALLOCATION_ALIGNMENT
