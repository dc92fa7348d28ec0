"""DeepSeek-V2/V3 with dense MLPs: multi-head latent attention (MLA) in every layer, a gated
SiLU MLP, pre-RMSNorms and residuals.

Each token's attention state is one latent: ``kv_a_proj_with_mqa`` maps the hidden state to
``c`` (``kv_lora_rank``, normalised) and a rope key ``k_pe`` (``qk_rope_head_dim``) that every
head shares. Only ``[c | k_pe]`` is cached (``MLAAttentionSpec``); ``kv_b_proj`` expands ``c``
into each head's nope key and value when attention needs them (``workers.layers.mla_attention``).

Tensor parallelism splits the query heads (``q_proj``/``q_b_proj``, ``kv_b_proj``, ``o_proj``)
and keeps the latent projections whole, so every rank caches the same latents.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from workers.deepseek_config import mla_softmax_scale
from workers.kv_specs import attention_layer_name
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from workers.layers.mla_attention import MLAAttention
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.model_config import ModelConfig
from workers.models.llama import LlamaMLP
from workers.parallel import get_tp_group

# transformers builds the latent norms with RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(ColumnParallelLinear):
    """``kv_b_proj``: the latent to each of this rank's heads' ``[k_nope | v]``. Its weight is
    read per head by the absorbed decode, so it stays in the checkpoint layout (unpacked)."""

    def pack_for_cpu(self) -> bool:
        return False


class DeepseekAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
    ):
        super().__init__()
        mla, hidden = config.mla, config.hidden_size
        heads = config.num_attention_heads
        self.num_heads = divide(heads, get_tp_group().world_size, "num_attention_heads")
        self.mla = mla
        bias = mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden, heads * mla.qk_head_dim, bias=False, dtype=dtype
            )
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(
                mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, dtype=dtype
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.latent_size, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = LatentUpProjection(
            mla.kv_lora_rank,
            heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            bias=False,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=bias, dtype=dtype)
        self.rotary_emb = rotary_emb  # one for the whole model
        self.attn = MLAAttention(
            attention_layer_name(layer_index),
            self.num_heads,
            mla,
            scale=mla_softmax_scale(mla, config.rope_scaling),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens, mla = hidden.shape[0], self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        kv_c = self.kv_a_layernorm(kv_c)  # the cache holds the normalised latent
        q_pe = self.rotary_emb.rotate(positions, q_pe)
        k_pe = self.rotary_emb.rotate(positions, k_pe[:, None, :])[:, 0]  # one head, rotated
        out = self.attn(q_nope, q_pe, kv_c, k_pe, self.kv_b_proj.weight)
        return self.o_proj(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.self_attn = DeepseekAttention(config, layer_index, dtype, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.mlp = LlamaMLP(config, dtype)  # dense: gate, up and down, SiLU, no biases

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype
        )
        rotary_emb = RotaryEmbedding(
            config.mla.qk_rope_head_dim,
            config.rope_theta,
            config.rope_scaling,
            is_interleaved=config.mla.rope_interleave,
        )
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, dtype, rotary_emb)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(token_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class DeepseekForCausalLM(nn.Module):
    """Serves ``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM`` checkpoints."""

    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(token_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()

    def kv_cache_layers(self) -> dict[str, MLAAttention]:
        return {
            layer.self_attn.attn.layer_name: layer.self_attn.attn for layer in self.model.layers
        }
