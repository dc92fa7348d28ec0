"""``kvray plan`` for DeepSeek's multi-head latent attention: the latent page, and how many
tokens a full K/V cache of the same model would fit in the same memory instead. Expected
figures are worked out here from the config numbers, not read back from the output."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_cli import run
from tests.workers.hf_models import DEEPSEEK_V3

BLOCK = 16  # kvray's default block size
MEMORY = 8 << 20
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

# deepseek-ai/DeepSeek-V3's published config.json, dense (first_k_dense_replace =
# num_hidden_layers: kvray refuses MoE layers); its fp8 quantization_config is left out, since
# the plan's figures are those of a bf16 cache.
DEEPSEEK_V3_PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 61,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def expected_lines(raw: dict, tp: int, dtype_bytes: int, memory: int, max_model_len: int):
    """The two plan lines, from the config's numbers: the latent (kv_lora_rank + rope dims) is
    whole on each rank; a full cache holds K (nope + rope) and V for this rank's heads."""
    layers = raw["num_hidden_layers"]
    qk_head_dim = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    heads = raw["num_attention_heads"] // tp
    latent = (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * dtype_bytes
    full = heads * (qk_head_dim + raw["v_head_dim"]) * dtype_bytes
    num_blocks = memory // (layers * BLOCK * latent)
    num_full_blocks = num_blocks * latent // full  # the latent pool's bytes in full blocks
    blocks_per_request = -(-max_model_len // BLOCK)
    tokens = int(num_blocks / blocks_per_request * max_model_len)
    full_tokens = int(num_full_blocks / blocks_per_request * max_model_len)
    return (
        f"latent (MLA): {latent} bytes per token per layer, page {BLOCK * latent} bytes per block",
        f"  vs a full K/V cache of this rank's {heads} query heads x "
        f"({qk_head_dim} + {raw['v_head_dim']}): {full} bytes per token per layer "
        f"({full / latent:.1f}x the latent); the same memory would fit {full_tokens} tokens "
        f"instead of {tokens}",
    )


def plan_lines(*args: str) -> list[str]:
    result = run("plan", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_plan_shows_the_latent_page_and_the_full_cache_it_replaces(tmp_path):
    """The tiny test model at TP 2: the latent stays whole, the full cache's heads split."""
    raw = DEEPSEEK_V3 | {"architectures": ["DeepseekV3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))  # the plan reads no weights
    lines = plan_lines("--model", str(tmp_path), "--kv-cache-memory", "8MiB", "-tp", "2")
    expected = expected_lines(raw, 2, 4, MEMORY, DEEPSEEK_V3["max_position_embeddings"])
    index = lines.index(expected[0])
    assert tuple(lines[index : index + 2]) == expected
    for layout in LAYOUTS:  # the latent is one head: every layout expresses it
        assert f"  {layout}: {raw['num_hidden_layers']} layers (" in "\n".join(lines)


@pytest.mark.parametrize("tp, ratio", [(1, "71.1x"), (8, "8.9x")])
def test_plan_of_deepseek_v3_from_its_config_alone(tmp_path, tp, ratio):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_PUBLISHED))
    memory, max_model_len = 4 << 30, 4096
    lines = plan_lines(
        "--model",
        str(tmp_path),
        "--kv-cache-memory",
        "4GiB",
        "--max-model-len",
        str(max_model_len),
        "-tp",
        str(tp),
    )
    expected = expected_lines(DEEPSEEK_V3_PUBLISHED, tp, 2, memory, max_model_len)
    assert expected[0] == "latent (MLA): 1152 bytes per token per layer, page 18432 bytes per block"
    assert f"({ratio} the latent)" in expected[1]
    index = lines.index(expected[0])
    assert tuple(lines[index : index + 2]) == expected
