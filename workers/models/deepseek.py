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

from workers.kinds.attention import attention_layer_name
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
from workers.models.deepseek_config import mla_softmax_scale
from workers.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
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


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (pre-norms, residuals, the dense gated SiLU MLP) around MLA."""

    attention_class = DeepseekAttention


class DeepseekModel(LlamaModel):
    layer_class = DeepseekDecoderLayer

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        mla = config.mla
        return RotaryEmbedding(
            mla.qk_rope_head_dim,
            config.rope_theta,
            config.rope_scaling,
            is_interleaved=mla.rope_interleave,
        )


class DeepseekForCausalLM(LlamaForCausalLM):
    """Serves ``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM`` checkpoints."""

    model_class = DeepseekModel
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
