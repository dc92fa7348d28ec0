"""DeepSeek-V2/V3 configs: what is read (the latent geometry; which layers are MoE, and how
each architecture routes), what is refused by name (unknown routing, unknown RoPE scalings,
other activations), the yarn softmax-scale correction, and the startup handshake of the latent
cache (whole on every rank)."""

from __future__ import annotations

import math

import msgspec
import pytest

from cluster.config import EngineConfig
from cluster.startup import plan_kv_cache
from kvcore import GeometryMismatchError, MLAAttentionSpec, RankReport
from workers.kv_specs import rank_kv_cache_specs
from workers.model_config import UnsupportedModelError
from workers.models.deepseek_config import mla_softmax_scale
from workers.models.registry import parse_hf_config

RAW = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MOE = RAW | {
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
}


def test_moe_layers_and_each_architectures_routing():
    v3 = parse_hf_config(MOE).moe
    assert v3.layers == (1,) and (v3.num_experts, v3.top_k, v3.intermediate_size) == (8, 2, 32)
    assert (v3.routing, v3.n_group, v3.topk_group, v3.norm_topk_prob) == ("noaux_tc", 4, 2, True)
    assert v3.shared_expert_intermediate_size == 64 and not v3.shared_expert_gated
    assert v3.routed_scaling_factor == 2.5
    v2 = parse_hf_config(MOE | {"architectures": ["DeepseekV2ForCausalLM"]}).moe
    assert (v2.routing, v2.n_group, v2.norm_topk_prob) == ("greedy", 1, False)
    limited = MOE | {"architectures": ["DeepseekV2ForCausalLM"]}
    limited |= {"topk_method": "group_limited_greedy"}
    assert parse_hf_config(limited).moe.routing == "group_limited_greedy"
    # V3 keeps 3 layers dense by default, V2 none.
    deep = {k: v for k, v in MOE.items() if k != "first_k_dense_replace"}
    assert parse_hf_config(deep | {"num_hidden_layers": 5}).moe.layers == (3, 4)
    v2_layers = parse_hf_config(deep | {"architectures": ["DeepseekV2ForCausalLM"]}).moe.layers
    assert v2_layers == (0, 1)
    assert parse_hf_config(RAW).moe is None  # first_k_dense_replace = num_hidden_layers


def test_a_dense_v3_config_reads_its_latent_geometry():
    config = parse_hf_config(RAW)
    mla = config.mla
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.latent_size, mla.qk_head_dim) == (
        16,
        None,
        24,
        24,
    )
    assert mla.rope_interleave  # V3's default
    assert config.layer_types == ("mla_attention", "mla_attention")
    assert config.head_dim == 8  # RoPE turns the rope part only
    spec = rank_kv_cache_specs(config, 16, 1, 0)[LAYERS[0]]
    assert spec == MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=24, head_size_v=0, dtype="float32"
    )
    assert spec.page_size_bytes == 16 * 24 * 4  # one latent per token, no separate V


def test_v2_rotates_interleaved_pairs_whatever_rope_interleave_says():
    raw = RAW | {"architectures": ["DeepseekV2ForCausalLM"], "rope_interleave": False}
    assert parse_hf_config(raw).mla.rope_interleave
    assert not parse_hf_config(RAW | {"rope_interleave": False}).mla.rope_interleave


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            MOE | {"topk_method": "group_limited_greedy"},
            r"Unsupported topk_method 'group_limited_greedy' for DeepseekV3ForCausalLM; "
            r"supported: noaux_tc",
        ),
        (
            MOE | {"architectures": ["DeepseekV2ForCausalLM"], "scoring_func": "sigmoid"},
            r"Unsupported scoring_func 'sigmoid' for DeepseekV2ForCausalLM; supported: softmax",
        ),
        (MOE | {"n_group": 3}, r"n_group=3 must divide n_routed_experts=8"),
        (MOE | {"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
        (
            RAW | {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            r"Unsupported RoPE type 'longrope'\. Supported RoPE types: default, llama3, yarn",
        ),
        (RAW | {"hidden_act": "gelu"}, r"Unsupported hidden_act 'gelu'; supported: silu"),
        (RAW | {"qk_rope_head_dim": 7}, r"qk_rope_head_dim=7 must be even"),
        # DeepSeek-V3's published weights are fp8 with block scales.
        (
            RAW | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
            r"Quantized checkpoints are not served yet \(quantization_config: fp8\)",
        ),
    ],
)
def test_what_kvray_cannot_serve_is_refused_by_name(raw, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(raw)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
         "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ],
)  # fmt: skip
def test_softmax_scale_matches_transformers(rope):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = parse_hf_config(RAW if rope is None else RAW | {"rope_scaling": rope})
    head = RAW["qk_nope_head_dim"] + RAW["qk_rope_head_dim"]
    theirs = yarn_apply_mscale(rope or {"rope_type": "default"}, head**-0.5)
    assert math.isclose(mla_softmax_scale(config.mla, config.rope_scaling), theirs, rel_tol=1e-12)
    if rope is not None and rope.get("mscale_all_dim"):
        assert theirs > head**-0.5 * 1.01  # the correction is in play


CONFIG = EngineConfig(
    tensor_parallel_size=2, kv_cache_layout="LBHNC", block_size=16, attention_backend="torch"
)


def reports(model_config) -> list[RankReport]:
    return [
        RankReport(
            rank=rank,
            specs=rank_kv_cache_specs(model_config, 16, 2, rank),
            supported_layouts=["LBHNC"],
            free_memory_bytes=8 << 20,
        )
        for rank in range(2)
    ]


def test_every_rank_holds_the_whole_latent_and_the_handshake_agrees():
    """Query heads split over TP 2, the latent does not: both ranks report the global spec."""
    model_config = parse_hf_config(RAW)
    both = reports(model_config)
    whole = rank_kv_cache_specs(model_config, 16, 1, 0)
    assert both[0].specs == both[1].specs == whole
    plan = plan_kv_cache(both, model_config, CONFIG)
    assert [sorted(g.layer_names) for g in plan.kv_cache_groups] == [LAYERS]


def test_a_tensor_parallel_size_that_does_not_divide_the_query_heads_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads=4 is not divisible by "
                       r"tensor parallel size 3: MLA splits the query heads"):  # fmt: skip
        rank_kv_cache_specs(parse_hf_config(RAW), 16, 3, 0)


def test_a_rank_that_splits_the_latent_is_refused():
    """A rank that sharded the latent by heads (halving it) would read other tokens' bytes."""
    model_config = parse_hf_config(RAW)
    bad = reports(model_config)
    split = msgspec.structs.replace(bad[1].specs[LAYERS[1]], head_size=12)
    bad[1] = msgspec.structs.replace(bad[1], specs=bad[1].specs | {LAYERS[1]: split})
    with pytest.raises(GeometryMismatchError, match=r"rank 1.*model\.layers\.1.*head_size"):
        plan_kv_cache(bad, model_config, CONFIG)
