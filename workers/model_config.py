"""The model geometry kvray needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

# Architectures served by the Llama-family model code, and what distinguishes them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture or configuration kvray does not serve."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises each query and key head before RoPE
    # One entry per layer: "full_attention" or "sliding_attention".
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"

    def is_sliding(self, layer_index: int) -> bool:
        return self.layer_types[layer_index] == "sliding_attention"


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"No config.json in model directory {model_dir}")
    return parse_hf_config(json.loads(path.read_text()))


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else "<none>"
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"Unsupported architecture {architecture!r}. Supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    layer_types, window = _layer_types(raw, architecture, num_layers)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        **_biases(raw, architecture),
        qk_norm=architecture == "Qwen3ForCausalLM",
        layer_types=layer_types,
        sliding_window=window,
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        dtype=DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), "float32"),
    )


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(
            f"Unsupported RoPE type {rope_type!r}. Supported RoPE types: default"
        )
    return float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _layer_types(raw: dict[str, Any], architecture: str, num_layers: int):
    """Which layers use a sliding window, and the window (None when no layer does)."""
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"Unsupported hidden_act {hidden_act!r}; supported: silu")
    window = raw.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get(
        "use_sliding_window"
    ):
        window = None
    types = raw.get("layer_types")
    if types is None:
        kind = "sliding_attention" if window is not None else "full_attention"
        types = [kind] * num_layers
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(
            f"layer_types must name full_attention or sliding_attention for each of the "
            f"{num_layers} layers, got {types}"
        )
    if window is None:
        types = ["full_attention"] * num_layers
    return tuple(types), window


def _biases(raw: dict[str, Any], architecture: str) -> dict[str, bool]:
    """Which projections carry a bias: Qwen2 always on Q/K/V only; Mistral never; Llama and
    Qwen3 on Q/K/V/O when ``attention_bias`` (and Llama on the MLP when ``mlp_bias``)."""
    if architecture == "Qwen2ForCausalLM":
        return {"qkv_bias": True, "o_proj_bias": False, "mlp_bias": False}
    if architecture == "MistralForCausalLM":
        return {"qkv_bias": False, "o_proj_bias": False, "mlp_bias": False}
    attention_bias = bool(raw.get("attention_bias"))
    mlp_bias = architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias"))
    return {"qkv_bias": attention_bias, "o_proj_bias": attention_bias, "mlp_bias": mlp_bias}
