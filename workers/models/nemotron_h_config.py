"""NemotronH's ``config.json``: the layer pattern (``layers_block_type``, or the older
``hybrid_override_pattern`` letters), the Mamba-2 mixer's geometry, and refusals, by name, of
what kvray does not serve (MoE layers, other activations)."""

from __future__ import annotations

from typing import Any

from kvcore.dtypes import MODEL_DTYPES
from workers.model_config import (
    MambaConfig,
    ModelConfig,
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
    "moe": None,
}


def parse_nemotron_h(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    """NemotronH: Mamba-2 (M), attention without RoPE (*) and relu² MLP (-) layers."""
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise UnsupportedModelError(f"Unsupported {key} {raw[key]!r}; supported: {want}")
    layer_types = _layer_types(raw)
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
        if NEMOTRON_H_BLOCK_TYPES[block_type] is None:
            raise UnsupportedModelError(
                f"Layer {index} is a {block_type} (mixture-of-experts, 'E') layer; kvray does "
                "not serve MoE layers yet. Served NemotronH layers: linear_attention (M), "
                "full_attention (*), mlp (-)."
            )
        types.append(NEMOTRON_H_BLOCK_TYPES[block_type])
    return tuple(types)
