"""Tiny random-weight Hugging Face models, built from a config and saved to a directory, and
their greedy generations: the reference kvray's workers must match token for token."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [100, 3, 4],
    list(range(30, 60)),
]
NUM_OUTPUT_TOKENS = 32

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # Large weights make the greedy tokens vary from step to step (a model that repeats one
    # token would prove little).
    initializer_range=0.5,
    max_position_embeddings=512,
)


def build_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**COMMON)
    if family == "llama-tied":
        return LlamaConfig(**COMMON, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**COMMON)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=8)
    if family == "qwen3-sliding":
        # Full and sliding-window layers interleaved: two KV-cache groups.
        return Qwen3Config(
            **COMMON,
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"] * 2,
        )
    if family in SPARSE:
        return SPARSE[family]()
    raise ValueError(family)


def _mixtral():
    from transformers import MixtralConfig

    dense = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    return MixtralConfig(**dense, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig

    # Layers 1 and 3 are MoE (decoder_sparse_step 2), with the gated shared expert.
    return Qwen2MoeConfig(
        **COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, shared_expert_intermediate_size=64, norm_topk_prob=False,
    )  # fmt: skip


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # Layer 1 keeps a dense MLP (mlp_only_layers); three of eight experts per token.
    return Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
        mlp_only_layers=[1], norm_topk_prob=True,
    )  # fmt: skip


def _gpt_oss():
    from transformers import GptOssConfig

    dense = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    yarn = {
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    }
    return GptOssConfig(
        **dense, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=yarn,
    )  # fmt: skip


SPARSE = {
    "mixtral": _mixtral, "qwen2-moe": _qwen2_moe, "qwen3-moe": _qwen3_moe, "gpt-oss": _gpt_oss,
}  # fmt: skip


def save_model(family: str, directory: Path, *, max_shard_size: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(family)).eval()
    for name, param in model.named_parameters():
        if name.endswith("_proj_bias"):  # gpt-oss's expert biases start at zero
            param.data.normal_(std=0.5)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def reference_generations(model_dir: Path, prompts=PROMPTS, num_tokens=NUM_OUTPUT_TOKENS):
    """transformers' greedy ``generate``, one prompt at a time (no padding in play)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    # Plain greedy, as the workers decode: with an EOS id, min_new_tokens would mask that
    # token's logit until the end (the random models' EOS, 2, is sometimes the best token).
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


# A tiny NemotronH: Mamba-2 (M), attention (*) and MLP (-) layers. chunk_size 8 puts several
# SSD chunks in every prompt.
NEMOTRON_H = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=8,
    initializer_range=0.5,
    rescale_prenorm_residual=False,  # full-size out_proj weights: tokens vary more
    max_position_embeddings=512,
)


def save_nemotron_h(
    directory: Path, layers, n_groups: int, *, score_bias_std: float = 0.0, **overrides
) -> Path:
    """``layers``: a pattern string (saved as the legacy ``hybrid_override_pattern``) or a
    ``layers_block_type`` list. MoE (``E``) layers' score biases are drawn with
    ``score_bias_std`` (transformers starts them at zero)."""
    import json

    from transformers import NemotronHConfig, NemotronHForCausalLM

    pattern = layers if isinstance(layers, str) else NemotronHConfig._list_to_pattern(layers)
    config = NemotronHConfig(
        **{**NEMOTRON_H, **overrides}, n_groups=n_groups, hybrid_override_pattern=pattern
    )
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config).eval()
    for layer in model.model.layers:
        router = getattr(layer.mixer, "gate", None)
        if score_bias_std and hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(std=score_bias_std)
    model.save_pretrained(directory)
    if isinstance(layers, str):  # write the legacy form, as older checkpoints do
        path = directory / "config.json"
        raw = json.loads(path.read_text())
        del raw["layers_block_type"]
        raw["hybrid_override_pattern"] = layers
        raw["num_hidden_layers"] = len(layers)
        path.write_text(json.dumps(raw))
    return directory


# A tiny dense DeepSeek-V3 (every layer dense: first_k_dense_replace = num_hidden_layers) with
# nope, rope and value head sizes all different, so no path may confuse them. Its geometry
# puts the expansion threshold (workers.kinds.mla_metadata) at 9 new tokens: prefill chunks of 9 or
# more expand their context, shorter ones attend in latent space, as decode does.
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=20,
    qk_rope_head_dim=6,
    v_head_dim=14,
    # No end-of-sequence id: transformers' min_new_tokens would mask it where kvray's
    # harness (which ignores EOS) takes it, and these models are untrained.
    eos_token_id=None,
    initializer_range=0.5,
    max_position_embeddings=512,
)


def save_deepseek(
    directory: Path, *, q_lora_rank: int | None, version: int = 3, **overrides
) -> Path:
    """A tiny dense DeepSeek-V3 (or V2: the same MLA, complex-number RoPE) saved in fp32."""
    from cluster.fixtures.random_checkpoint import save_random_checkpoint

    config = DEEPSEEK_V3 | overrides | {"q_lora_rank": q_lora_rank}
    save_random_checkpoint(directory, f"DeepseekV{version}", config, seed=0)
    return directory


# A tiny DeepSeek MoE: layer 0 dense, layers 1-2 MoE (8 routed experts in 4 groups, 2 chosen
# from the best 2 groups, two shared experts).
DEEPSEEK_MOE = dict(
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5,
)  # fmt: skip


def save_deepseek_moe(directory: Path, *, version: int = 3, **overrides) -> Path:
    """A tiny DeepSeek-V3 (sigmoid routing with a score bias, drawn here: transformers starts
    it at zero) or V2 (softmax routing, ``topk_method`` as given) MoE, saved in fp32."""
    import transformers

    config = DEEPSEEK_V3 | DEEPSEEK_MOE | {"q_lora_rank": 24} | overrides
    family = f"DeepseekV{version}"
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(
        getattr(transformers, f"{family}Config")(**config)
    ).eval()
    for layer in model.model.layers:
        router = getattr(layer.mlp, "gate", None)  # a dense layer's gate is gate_proj
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(std=0.2)
    model.save_pretrained(directory)
    return directory
