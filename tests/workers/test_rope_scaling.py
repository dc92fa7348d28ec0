"""Scaled RoPE (``llama3``, ``yarn``): the frequencies transformers computes, and greedy tokens
equal to transformers' ``generate`` on checkpoints whose scaling changes the output."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.workers.engine import KV_CACHE_MEMORY, run_in_process
from tests.workers.hf_models import COMMON, NUM_OUTPUT_TOKENS, PROMPTS, reference_generations
from workers.layers.rotary import rope_frequencies
from workers.model_config import UnsupportedModelError
from workers.models.registry import parse_hf_config
from workers.worker import WorkerOptions

# Real checkpoints' settings, and the corners of each formula.
FREQUENCY_CASES = [
    # Llama 3.1 8B
    (128, 500000.0, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama 3.2 1B
    (64, 500000.0, 131072, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen2.5's long-context recipe (the legacy "type" key)
    (128, 1000000.0, 131072, {"type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32768}),
    # DeepSeek's mscale pair, beta bounds of its own
    (64, 10000.0, 163840, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                           "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                           "original_max_position_embeddings": 4096}),
    # gpt-oss: no truncation of the ramp
    (64, 150000.0, 131072, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096}),
    # an explicit attention factor; no factor, so the lengths' ratio
    (32, 10000.0, 2048, {"rope_type": "yarn", "factor": None, "attention_factor": 0.8,
                         "original_max_position_embeddings": 512}),
]  # fmt: skip


def llama_config(head_dim: int, theta: float, max_len: int, rope_scaling: dict | None, **kw):
    from transformers import LlamaConfig

    common = {**COMMON, "head_dim": head_dim, "max_position_embeddings": max_len, **kw}
    return LlamaConfig(
        **common, rope_theta=theta, rope_scaling=rope_scaling, architectures=["LlamaForCausalLM"]
    )


@pytest.mark.parametrize(("head_dim", "theta", "max_len", "rope_scaling"), FREQUENCY_CASES)
def test_frequencies_equal_transformers_rope_init_functions(head_dim, theta, max_len, rope_scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = llama_config(head_dim, theta, max_len, dict(rope_scaling))
    rope_type = hf_config.rope_parameters["rope_type"]
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    # kvray reads the config.json transformers writes.
    config = parse_hf_config(hf_config.to_dict())
    inv_freq, factor = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert config.rope_scaling.rope_type == rope_type
    assert torch.equal(inv_freq, expected_inv_freq)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("scaling", [None, FREQUENCY_CASES[3][3]], ids=["plain", "yarn"])
def test_the_cpu_tables_give_each_position_its_cos_and_sin(scaling):
    """On CPUs a step's cos and sin are rows of tables kept across steps: each within a unit
    of float32's last place of the true value (Python's float64 math here), past the tables'
    first size too, and scaled by yarn's attention factor."""
    from workers.layers.rotary import RotaryEmbedding

    config = parse_hf_config(llama_config(64, 10000.0, 163840, scaling and dict(scaling)).to_dict())
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
    generator = torch.Generator().manual_seed(0)
    for top in (700, 5000):  # the second step grows the tables
        positions = torch.randint(0, top, (97,), generator=generator)
        cos, sin = rotary._cos_sin(positions)
        assert cos.is_contiguous() and sin.is_contiguous()
        angles = (positions.float()[:, None] * rotary.inv_freq[None, :]).tolist()
        for f, got in ((math.cos, cos), (math.sin, sin)):
            half = torch.tensor([[f(a) for a in row] for row in angles], dtype=torch.float64)
            expected = torch.cat((half, half), dim=-1) * rotary.attention_factor
            torch.testing.assert_close(got.double(), expected, rtol=1.2e-7, atol=6e-8)
    assert rotary._tables[0].shape[0] == 8192


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_half_precision_step_casts_its_tables_once_for_every_layer(interleaved):
    """Every layer of a bf16 model rotates by the step's tables cast once: the same result as
    casting them in each layer, one cast per step (a new step casts again)."""
    from workers.layers.rotary import RotaryEmbedding, _rotate, _rotate_pairs

    rotary = RotaryEmbedding(16, 10000.0, is_interleaved=interleaved)
    query = torch.randn(5, 2, 16).to(torch.bfloat16)
    for step in range(2):
        positions = torch.arange(5) + 7 * step
        layers = [rotary.rotate(positions, query)]
        cast = rotary._cast
        layers += [rotary.rotate(positions, query) for _ in range(2)]
        assert rotary._cast is cast  # the later layers reused the first one's
        assert cast[2].dtype == torch.bfloat16 and cast[0] is rotary._cos_sin(positions)[0]
        rotary._cast = None  # the per-layer cast, to compare with
        cos, sin = (t.to(torch.bfloat16)[:, None, :] for t in rotary._cos_sin(positions))
        expected = (_rotate_pairs if interleaved else _rotate)(query, cos, sin)
        assert all(torch.equal(layer, expected) for layer in layers)
        rotary._cast = cast


def test_unknown_rope_types_are_refused_listing_the_supported_ones():
    raw = llama_config(16, 10000.0, 64, None).to_dict()
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match=r"'longrope'.*default, llama3, yarn"):
        parse_hf_config(raw)
    raw["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    with pytest.raises(UnsupportedModelError, match="needs high_freq_factor"):
        parse_hf_config(raw)


# Pretraining "lengths" of 16 positions, so the 19-62 positions of PROMPTS run well past them.
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip


def save_scaled_model(rope_scaling: dict | None, directory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # A small base makes every dimension turn within the prompts, so scaling moves them all.
    config = llama_config(16, 100.0, 64, rope_scaling and dict(rope_scaling))
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_greedy_tokens_match_transformers(tmp_path, name):
    model_dir = save_scaled_model(SCALINGS[name], tmp_path / name)
    expected = reference_generations(model_dir, PROMPTS)
    options = WorkerOptions(
        model=str(model_dir),
        block_size=4,
        attention_backend="torch",
        kv_cache_memory_bytes=KV_CACHE_MEMORY,
    )
    batch = [(f"r{i}", prompt, NUM_OUTPUT_TOKENS, None) for i, prompt in enumerate(PROMPTS)]
    outputs = run_in_process(options, "LBNHC", [batch], chunk=7)
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert all(len(set(tokens)) > 8 for tokens in expected)
    # The same weights without scaling generate otherwise: the scaling is what was compared.
    unscaled = reference_generations(save_scaled_model(None, tmp_path / "unscaled"), PROMPTS)
    assert unscaled != expected


# generation_config.json is read beside config.json, like the rope parameters (kept here, with
# the other config.json parsing this change brought).
def test_generation_config_adds_eos_ids_and_sampling_defaults(tmp_path):
    import msgspec
    from transformers import GenerationConfig

    from workers.model_config import ModelConfig
    from workers.models.registry import load_model_config

    config = llama_config(16, 10000.0, 64, SCALINGS["llama3"], eos_token_id=2)
    config.save_pretrained(tmp_path)
    assert load_model_config(tmp_path).default_sampling == {}
    GenerationConfig(
        eos_token_id=[7, 2], do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=100
    ).save_pretrained(tmp_path)
    loaded = load_model_config(tmp_path)
    assert loaded.eos_token_ids == (2, 7)  # config.json's first, no repeats
    assert loaded.default_sampling == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 100}
    assert loaded.max_position_embeddings == 64
    # The config crosses process boundaries as msgspec.
    assert msgspec.json.decode(msgspec.json.encode(loaded), type=ModelConfig) == loaded

    # Older transformers wrote files like this one (today's refuses to).
    greedy = {"eos_token_id": 3, "do_sample": False, "temperature": 0.7, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps(greedy))
    loaded = load_model_config(tmp_path)
    assert loaded.eos_token_ids == (2, 3)
    assert loaded.default_sampling == {"temperature": 0.0}  # greedy: temperature and top_k unused
