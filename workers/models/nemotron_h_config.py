"""NemotronH's ``config.json``: the layer pattern (``layers_block_type``, or the older
``hybrid_override_pattern`` letters), the Mamba-2 mixer's geometry, the mixture-of-experts
(``E``) layers' experts, and refusals, by name, of what kvray does not serve (other
activations)."""

from __future__ import annotations

from typing import Any

from kvcore.dtypes import MODEL_DTYPES
from workers.model_config import (
    MambaConfig,
    ModelConfig,
    MoEConfig,
    UnsupportedModelError,
    common_fields,
)

# NemotronH's legacy ``hybrid_override_pattern`` letters and its ``layers_block_type`` names,
# each mapped to kvray's layer type (None: known, but not served yet).
NEMOTRON_H_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
NEMOTRON_H_BLOCK_TYPES = {
    "linear_attention": "mamba",
    "full_attention": "full_attention",
    "mlp": "mlp",
    "moe": "moe",  # an MLP block of routed experts: no cache, as "mlp"
}


def parse_nemotron_h(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    """NemotronH: Mamba-2 (M), attention without RoPE (*) and relu² MLP (-) layers."""
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise UnsupportedModelError(f"Unsupported {key} {raw[key]!r}; supported: {want}")
    block_types = _layer_types(raw)
    moe = _moe(raw, [i for i, kind in enumerate(block_types) if kind == "moe"])
    layer_types = tuple("mlp" if kind == "moe" else kind for kind in block_types)
    heads = raw.get("num_attention_heads", 32)
    ssm_dtype = raw.get("mamba_ssm_cache_dtype") or "float32"
    if ssm_dtype not in (*MODEL_DTYPES, "auto"):
        raise UnsupportedModelError(
            f"Unsupported mamba_ssm_cache_dtype {ssm_dtype!r}; supported: auto, "
            f"{', '.join(MODEL_DTYPES)}"
        )
    mamba = MambaConfig(
        num_heads=raw.get("mamba_num_heads", 128),
        head_dim=raw.get("mamba_head_dim", 64),
        state_size=raw.get("ssm_state_size", 128),
        n_groups=raw.get("n_groups", raw.get("mamba_n_groups", 8)),
        conv_kernel=raw.get("conv_kernel", raw.get("mamba_d_conv", 4)),
        chunk_size=raw.get("chunk_size", raw.get("mamba_chunk_size", 128)),
        use_conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        proj_bias=bool(raw.get("use_bias", False)),
        dt_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
        ssm_cache_dtype="float32" if ssm_dtype == "auto" else ssm_dtype,
    )
    if mamba.num_heads % mamba.n_groups:
        raise UnsupportedModelError(
            f"mamba_num_heads={mamba.num_heads} is not divisible by n_groups={mamba.n_groups}"
        )
    return ModelConfig(
        **common_fields(raw, generation),
        vocab_size=raw.get("vocab_size", 131072),
        hidden_size=raw.get("hidden_size", 4096),
        intermediate_size=raw.get("intermediate_size", 21504),
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw.get("hidden_size", 4096) // heads,
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        # transformers' NemotronH attention has no biases, whatever attention_bias says.
        mlp_bias=bool(raw.get("mlp_bias", False)),
        layer_types=layer_types,
        attention_module="mixer",
        mamba=mamba,
        moe=moe,
    )


def _layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's kvray type, from ``layers_block_type`` or ``hybrid_override_pattern``."""
    block_types = raw.get("layers_block_type") or raw.get("layer_types")
    if block_types is None:
        pattern = raw.get("hybrid_override_pattern")
        if not pattern:
            raise UnsupportedModelError(
                "NemotronH config needs layers_block_type or hybrid_override_pattern"
            )
        block_types = []
        for position, letter in enumerate(pattern):
            if letter not in NEMOTRON_H_LETTERS:
                known = ", ".join(f"{k} ({v})" for k, v in NEMOTRON_H_LETTERS.items())
                raise UnsupportedModelError(
                    f"hybrid_override_pattern {pattern!r} has an unknown layer letter "
                    f"{letter!r} at position {position}; known letters: {known}"
                )
            block_types.append(NEMOTRON_H_LETTERS[letter])
    types = []
    for index, block_type in enumerate(block_types):
        if block_type not in NEMOTRON_H_BLOCK_TYPES:
            raise UnsupportedModelError(
                f"Layer {index} has an unknown block type {block_type!r}; known: "
                f"{', '.join(NEMOTRON_H_BLOCK_TYPES)}"
            )
        types.append(NEMOTRON_H_BLOCK_TYPES[block_type])
    return tuple(types)


def _moe(raw: dict[str, Any], layers: list[int]) -> MoEConfig | None:
    """The ``E`` layers' experts: ungated relu² MLPs (in ``moe_latent_size`` when set), routed
    as DeepSeek-V3 routes (sigmoid scores plus a learned bias over expert groups), and one
    ungated shared expert of ``moe_shared_expert_intermediate_size`` rows."""
    if not layers:
        return None
    num_experts = raw.get("n_routed_experts") or raw.get("num_local_experts") or 0
    top_k = raw.get("num_experts_per_tok") or 1
    n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts"
        )
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise UnsupportedModelError(
            f"n_group={n_group} must divide n_routed_experts={num_experts}, and topk_group="
            f"{topk_group} be between 1 and n_group"
        )
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        layers=tuple(layers),
        shared_expert_intermediate_size=raw.get("moe_shared_expert_intermediate_size") or 0,
        shared_expert_gated=False,
        routing="noaux_tc",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        router_in_float32=True,
        gated=False,
        activation="relu2",
        latent_size=raw.get("moe_latent_size") or 0,
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )
