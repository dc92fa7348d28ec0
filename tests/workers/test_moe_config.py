"""MoE checkpoints' configs and weights: which layers are MoE in each family, how experts are
placed on ranks (and refused when they cannot be), the startup check of every rank's share,
and the two ways checkpoints store experts (one by one, stacked) loading the same weights."""

from __future__ import annotations

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.hf_models import save_model
from workers.expert_placement import ExpertPlacementError, ExpertReport, check_expert_placements
from workers.loader import CheckpointError, load_state_dict, load_weights
from workers.model_config import ExpertShard, UnsupportedModelError
from workers.models.registry import load_model_config, model_class_for, parse_hf_config

QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,  # as published: transformers 5 writes num_local_experts
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}


def test_which_layers_are_moe():
    qwen2 = parse_hf_config(QWEN2_MOE).moe
    # (i + 1) % 2 == 0 gives 1, 3, 5; mlp_only_layers takes 3 back.
    assert qwen2.layers == (1, 5) and qwen2.num_experts == 8 and qwen2.top_k == 2
    assert qwen2.shared_expert_intermediate_size == 48 and not qwen2.norm_topk_prob
    mixtral = parse_hf_config(
        {**QWEN2_MOE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4}
    )
    assert mixtral.moe.layers == tuple(range(6)) and mixtral.moe.intermediate_size == 128
    assert mixtral.moe.norm_topk_prob and mixtral.moe.shared_expert_intermediate_size == 0
    qwen3 = parse_hf_config({**QWEN2_MOE, "architectures": ["Qwen3MoeForCausalLM"]})
    assert qwen3.qk_norm and qwen3.moe.shared_expert_intermediate_size == 0
    assert parse_hf_config({**QWEN2_MOE, "architectures": ["Qwen2ForCausalLM"]}).moe is None


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 must be between 1"):
        parse_hf_config({**QWEN2_MOE, "num_experts_per_tok": 9})


def test_placement_splits_experts_or_their_rows_and_refuses_what_does_not_divide():
    moe = parse_hf_config(QWEN2_MOE).moe
    assert moe.placement(2, 1, expert_parallel=False) == ExpertShard(0, 8, 16, 16)
    assert moe.placement(4, 3, expert_parallel=True) == ExpertShard(6, 2, 0, 32)
    with pytest.raises(UnsupportedModelError, match=r"num_experts=8 divisible by .* size 3"):
        moe.placement(3, 0, expert_parallel=True)
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size=32 is not divisible"):
        moe.placement(64, 0, expert_parallel=False)


def reports(tp: int, expert_parallel: bool) -> list[ExpertReport]:
    moe = parse_hf_config(QWEN2_MOE).moe
    return [
        ExpertReport(
            rank=rank,
            tp_size=tp,
            expert_parallel=expert_parallel,
            layers={
                f"model.layers.{i}.mlp.experts": moe.placement(tp, rank, expert_parallel)
                for i in moe.layers
            },
        )
        for rank in range(tp)
    ]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_every_rank_holding_its_share_passes_the_startup_check(expert_parallel):
    check_expert_placements(reports(4, expert_parallel))
    check_expert_placements(reports(4, expert_parallel)[2:3])  # one rank's process alone


def test_a_rank_holding_other_experts_is_named():
    bad = reports(2, expert_parallel=True)
    layer = "model.layers.5.mlp.experts"
    bad[1] = msgspec.structs.replace(
        bad[1], layers=bad[1].layers | {layer: ExpertShard(0, 4, 0, 32)}
    )
    with pytest.raises(
        ExpertPlacementError,
        match=r"Rank 1, layer model\.layers\.5\.mlp\.experts: holds experts \[0, 4\).*"
        r"expected experts \[4, 8\)",
    ):
        check_expert_placements(bad)
    mixed = reports(2, expert_parallel=False)[:1] + reports(2, expert_parallel=True)[1:]
    with pytest.raises(ExpertPlacementError, match="Rank 1 splits experts over 2 ranks"):
        check_expert_placements(mixed)


def build(model_dir):
    config = load_model_config(model_dir)
    return model_class_for(config)(config)


def test_stacked_experts_load_the_same_weights_as_per_expert_ones(tmp_path):
    model_dir = save_model("qwen3-moe", tmp_path)
    per_expert = build(model_dir)
    load_weights(per_expert, model_dir, show_progress=False)
    tensors = load_file(model_dir / "model.safetensors")
    stacked = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stacked[name] = tensor
    for layer in {n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n}:

        def expert(e, projection, layer=layer):
            return tensors[f"{layer}.mlp.experts.{e}.{projection}.weight"]

        count = 8
        stacked[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(count)]
        )
        stacked[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [expert(e, "down_proj") for e in range(count)]
        )
    from_stacked = build(model_dir)
    load_state_dict(from_stacked, stacked)
    for (name, a), (_, b) in zip(
        per_expert.named_parameters(), from_stacked.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_missing_expert_is_named(tmp_path):
    model_dir = save_model("mixtral", tmp_path)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.w13.*part \(3, 'up'\)"
    ):
        load_weights(build(model_dir), model_dir, show_progress=False)


GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "experts_per_token": 2,  # published configs also write this name
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64},
}  # fmt: skip


def test_gpt_oss_reads_its_sinks_windows_and_experts():
    config = parse_hf_config(GPT_OSS)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.sliding_window == 8 and config.qkv_bias and config.o_proj_bias
    assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
    moe = config.moe
    assert moe.layers == (0, 1, 2, 3) and (moe.num_experts, moe.top_k) == (8, 2)
    assert (moe.routing, moe.activation, moe.swiglu_limit) == ("topk_softmax", "swiglu_oai", 7.0)
    assert moe.router_bias and moe.expert_bias and moe.stacked_layout == "gpt_oss"
    mxfp4 = GPT_OSS | {"quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedModelError, match=r"quantization_config: mxfp4"):
        parse_hf_config(mxfp4)


def test_cpu_workers_pack_each_experts_weights_for_onednn():
    """As the dense layers are packed (workers.layers.cpu_matmul): the same outputs, and the
    unpacked stacks let go."""
    from workers.layers.cpu_matmul import pack_linear_weights
    from workers.layers.moe import SparseMoE

    moe = parse_hf_config(QWEN2_MOE).moe
    layer = SparseMoE(64, moe, torch.float32)
    for param in layer.parameters():
        param.data.normal_(std=0.1)
    x = torch.randn(9, 64)
    with torch.inference_mode():
        before = layer(x)
        if pack_linear_weights(layer) == 0:
            pytest.skip("this torch has no oneDNN")  # the unpacked path is what runs then
        assert layer.experts.w13.numel() == 0 and layer.experts.w2.numel() == 0
        assert torch.allclose(layer(x), before, atol=1e-5)


def test_deepseek_routes_in_float32_whatever_its_scaling_factor():
    """DeepSeek-V2-Lite's routed_scaling_factor is 1.0: it must still score in float32, as
    transformers does, not in the model's dtype."""
    from workers.layers.moe import Router
    from workers.models.deepseek_config import parse_deepseek

    raw = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "routed_scaling_factor": 1.0}  # fmt: skip
    moe = parse_deepseek(raw, {}).moe
    assert moe.router_in_float32 and not parse_hf_config(QWEN2_MOE).moe.router_in_float32
    router = Router(64, moe, torch.bfloat16)
    router.weight.data.normal_()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    weights, ids = router(x)
    scores = torch.softmax(x.float() @ router.weight.float().T, dim=-1)
    assert weights.dtype == torch.float32
    assert torch.equal(weights, scores.gather(1, ids))
