"""NemotronH configs: both layer-pattern forms, the Mamba geometry and per-rank state specs, and
clear refusals for what kvray does not serve."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from kvcore import FullAttentionSpec, MambaSpec
from workers.kinds import StateCaching
from workers.kv_specs import global_kv_cache_specs, rank_kv_cache_specs
from workers.model_config import UnsupportedModelError
from workers.models.registry import parse_hf_config

RAW = {
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 8,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention"],
    "dtype": "bfloat16",
}


def config(**changes):
    raw = {k: v for k, v in (RAW | changes).items() if v is not None}
    return parse_hf_config(raw)


def test_both_pattern_forms_give_the_same_layers():
    listed = config()
    legacy = config(layers_block_type=None, hybrid_override_pattern="M*-M", num_hidden_layers=4)
    assert listed.layer_types == legacy.layer_types == ("mamba", "full_attention", "mlp", "mamba")
    assert listed.mamba == legacy.mamba
    assert listed.mamba.intermediate_size == 64 and listed.mamba.dt_min == 0.001
    assert listed.mamba.ssm_cache_dtype == "float32"


def test_specs_hold_conv_state_in_model_dtype_and_ssm_state_in_float32():
    specs = global_kv_cache_specs(config(), block_size=16)
    names = ["model.layers.0.mixer", "model.layers.1.mixer.attn", "model.layers.3.mixer"]
    assert list(specs) == names
    mamba = specs["model.layers.0.mixer"]
    assert isinstance(mamba, MambaSpec) and mamba.mamba_cache_mode == "none"
    # conv: K-1 inputs of I + 2*G*N channels; SSM: [H, P, N].
    assert mamba.shapes == ((3, 64 + 2 * 2 * 16), (8, 8, 16))
    assert mamba.dtypes == ("bfloat16", "float32")
    assert mamba.page_size_bytes == 3 * 128 * 2 + 8 * 8 * 16 * 4
    assert isinstance(specs["model.layers.1.mixer.attn"], FullAttentionSpec)


@pytest.mark.parametrize(("n_groups", "conv_dim_per_rank"), [(2, 32 + 2 * 16), (1, 32 + 2 * 16)])
def test_rank_specs_shard_heads_and_split_or_replicate_groups(n_groups, conv_dim_per_rank):
    """TP 2: each rank holds half the heads; with two groups one each, with one group the
    whole group (its B and C are computed on every rank)."""
    for rank in range(2):
        spec = rank_kv_cache_specs(config(n_groups=n_groups), 16, 2, rank)["model.layers.0.mixer"]
        assert spec.shapes == ((3, conv_dim_per_rank), (4, 8, 16))


def test_unknown_pattern_letter_is_named():
    with pytest.raises(UnsupportedModelError, match=r"unknown layer letter 'X' at position 2"):
        config(layers_block_type=None, hybrid_override_pattern="M*X-")
    with pytest.raises(UnsupportedModelError, match=r"Layer 1 has an unknown block type 'ssm'"):
        config(layers_block_type=["linear_attention", "ssm"])


MOE = dict(
    layers_block_type=None, hybrid_override_pattern="M*E-", n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_group=2, topk_group=1, routed_scaling_factor=2.0,
)  # fmt: skip


def test_moe_layers_route_to_ungated_relu2_experts():
    moe_config = config(**MOE)
    assert moe_config.layer_types == ("mamba", "full_attention", "mlp", "mlp")  # no cache
    moe = moe_config.moe
    assert moe.layers == (2,) and (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
    assert (moe.gated, moe.activation, moe.routing) == (False, "relu2", "noaux_tc")
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (2, 1, 2.0)
    assert moe.shared_expert_intermediate_size == 48 and not moe.shared_expert_gated
    assert config(**MOE, moe_latent_size=16).moe.latent_size == 16
    with pytest.raises(UnsupportedModelError, match=r"n_group=3 must divide n_routed_experts=8"):
        config(**{**MOE, "n_group": 3})


def test_groups_and_heads_that_do_not_split_over_tp_are_refused():
    with pytest.raises(UnsupportedModelError, match=r"n_groups=2 cannot be split over tensor"):
        rank_kv_cache_specs(config(), 16, 4, 0)
    with pytest.raises(UnsupportedModelError, match=r"mamba_num_heads=8 is not divisible by"):
        rank_kv_cache_specs(config(), 16, 3, 0)
    # One group replicates onto any number of ranks that splits the heads.
    assert rank_kv_cache_specs(config(n_groups=1), 16, 8, 7)


def test_unserved_activations_and_cache_dtypes_are_refused():
    with pytest.raises(UnsupportedModelError, match="mlp_hidden_act 'silu'; supported: relu2"):
        config(mlp_hidden_act="silu")
    with pytest.raises(UnsupportedModelError, match="mamba_ssm_cache_dtype 'int8'"):
        config(mamba_ssm_cache_dtype="int8")


def test_with_state_caching_a_state_is_kept_every_interval_with_room_for_a_steps_checkpoints():
    caching = StateCaching(interval=128, max_num_batched_tokens=2048)
    spec = global_kv_cache_specs(config(), block_size=16, state_caching=caching)[
        "model.layers.0.mixer"
    ]
    assert (spec.block_size, spec.mamba_cache_mode) == (128, "align")
    assert spec.num_prefill_checkpoint_blocks == 16  # a 2048-token step crosses 16 boundaries
    # The current state, its copy source and a step's checkpoints.
    assert spec.max_memory_usage_bytes(4096, 2048) == 18 * spec.page_size_bytes


def test_a_state_interval_off_the_block_grid_is_refused():
    assert EngineConfig(mamba_state_interval=64).state_caching() == StateCaching(64, 2048)
    assert EngineConfig(enable_prefix_caching=False).state_caching() is None
    with pytest.raises(ValueError, match="mamba_state_interval"):
        EngineConfig(mamba_state_interval=100)  # not a multiple of the 16-token block
