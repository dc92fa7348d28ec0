"""The embedded default model: a small Llama-style network whose weights come from a fixed
seed, with the byte-level tokenizer. It needs no download, so a fresh machine can run kvray
end to end; its output is deterministic but, being untrained, not meaningful text."""

from __future__ import annotations

import msgspec
import torch
from torch import nn

from workers.model_config import ModelConfig, load_model_config
from workers.tokenizer import ByteTokenizer

DEFAULT_MODEL_NAME = "kvray-default-tiny"
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


def is_embedded(model: str | None) -> bool:
    return model is None or model.startswith(EMBEDDED_PREFIX)


def model_config_for(model: str | None) -> ModelConfig:
    """The config of a model directory, or of an embedded model (None = ``embedded:tiny``)."""
    if not is_embedded(model):
        return load_model_config(model)
    name = "tiny" if model is None else model[len(EMBEDDED_PREFIX) :]
    if name not in EMBEDDED_CONFIGS:
        raise ValueError(
            f"Unknown embedded model {model!r}; choose one of "
            f"{[EMBEDDED_PREFIX + n for n in EMBEDDED_CONFIGS]} or a model directory"
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
