"""The weights of the embedded models built in code (``embedded:tiny``, ``embedded:20m``;
their configs are ``workers.model_source``'s): drawn from a fixed seed, so every rank and
every run get the same network, deterministic but, being untrained, not meaningful text."""

from __future__ import annotations

import torch
from torch import nn

from workers.model_config import ModelConfig
from workers.model_source import DEFAULT_CONFIG

DEFAULT_SEED = 1234


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
