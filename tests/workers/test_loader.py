"""Checkpoint loading: sharded files, and clear refusals for broken checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.engine import KV_CACHE_MEMORY, run_in_process
from tests.workers.hf_models import PROMPTS, reference_generations, save_model
from workers.loader import CheckpointError, load_weights
from workers.model_config import UnsupportedModelError
from workers.models.registry import load_model_config, model_class_for
from workers.worker import WorkerOptions


def build(model_dir):
    config = load_model_config(model_dir)
    return model_class_for(config)(config)


def test_sharded_checkpoint_loads_and_generates(tmp_path):
    model_dir = save_model("llama", tmp_path, max_shard_size="100KB")
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(files) > 2 and (model_dir / "model.safetensors.index.json").is_file()
    options = WorkerOptions(
        model=str(model_dir), block_size=4, kv_cache_memory_bytes=KV_CACHE_MEMORY
    )
    batch = [[("r0", PROMPTS[1], 8, None)]]
    outputs = run_in_process(options, "LBNHC", batch, chunk=64)
    assert outputs["r0"] == reference_generations(model_dir, [PROMPTS[1]], 8)[0]


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    model_dir = save_model("llama", tmp_path)
    _rewrite(model_dir, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"Missing tensor 'model\.layers\.2\.self_attn"
        r"\.k_proj\.weight'",
    ):
        load_weights(build(model_dir), model_dir, show_progress=False)


def test_unexpected_and_misshapen_tensors_are_named(tmp_path):
    model_dir = save_model("llama", tmp_path)
    _rewrite(model_dir, lambda t: t.__setitem__("model.layers.9.extra.weight", torch.ones(2)))
    with pytest.raises(CheckpointError, match=r"Unexpected tensor 'model\.layers\.9\.extra"):
        load_weights(build(model_dir), model_dir, show_progress=False)

    model_dir = save_model("llama", tmp_path / "shape")
    _rewrite(model_dir, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*\(65,\), expected \(64,\)"):
        load_weights(build(model_dir), model_dir, show_progress=False)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    model_dir = save_model("llama", tmp_path)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError) as info:
        load_model_config(model_dir)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_unsupported_rope_scaling_is_refused(tmp_path):
    model_dir = save_model("llama", tmp_path)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="Unsupported RoPE type 'longrope'"):
        load_model_config(model_dir)
