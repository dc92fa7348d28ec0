"""The Llama family: Llama, Mistral, Qwen2 (Q/K/V biases) and Qwen3 (Q/K norms), with tied or
untied embeddings and per-layer full or sliding-window attention; and their sparse siblings
Mixtral, Qwen2-MoE and Qwen3-MoE, whose MoE layers route each token to experts
(``workers.layers.moe``)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from workers.kinds.attention import attention_layer_name
from workers.layers.attention import Attention
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
)
from workers.layers.missing import OtherStageLayer
from workers.layers.mlp import MLP
from workers.layers.moe import SparseMoE, expert_checkpoint_target
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.model_config import ModelConfig
from workers.models.llama_cpu_decode import CpuDecodePath
from workers.models.stage_parts import other_stages_parameter, stage_lm_head
from workers.stages import PipelineStage


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
    ):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
            dtype=dtype,
        )
        self.rotary_emb = rotary_emb  # one for the whole model
        self.q_norm = (
            RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        )
        window = config.sliding_window if config.is_sliding(layer_index) else None
        self.attn = Attention(
            attention_layer_name(layer_index),
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            sliding_window=window,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        num_heads, num_kv_heads = self.attn.num_heads, self.attn.num_kv_heads
        qkv = self.qkv_proj(hidden)
        q, k, v = self.qkv_proj.split(qkv)
        v = v.view(num_tokens, num_kv_heads, self.attn.head_size)  # [T, Hk, D]
        if self.q_norm is None:
            # Q and K sit side by side in qkv: one rotation for both heads' rows.
            qk = qkv[:, : q.shape[1] + k.shape[1]].view(num_tokens, num_heads + num_kv_heads, -1)
            q, k = self.rotary_emb.rotate(positions, qk).split([num_heads, num_kv_heads], dim=1)
        else:
            q = self.q_norm(q.view(num_tokens, num_heads, -1))  # [T, Hq, D]
            k = self.k_norm(k.view(num_tokens, num_kv_heads, -1))  # [T, Hk, D]
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    attention_class: ClassVar[type[nn.Module]] = LlamaAttention

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = self.attention_class(config, layer_index, dtype, rotary_emb)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )
        if config.is_moe(layer_index):
            self.mlp = SparseMoE(config.hidden_size, config.moe, dtype)
        else:
            self.mlp = MLP(
                config.hidden_size, config.intermediate_size, gated=True, activation="silu",
                bias=config.mlp_bias, dtype=dtype,
            )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    layer_class: ClassVar[type[nn.Module]] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype, stage: PipelineStage | None = None):
        super().__init__()
        self.stage = stage or PipelineStage.whole(config.num_hidden_layers)
        self.embed_tokens = None
        if self.stage.holds_embedding(config.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, dtype=dtype
            )
        rotary_emb = self.rotary_embedding(config)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, dtype, rotary_emb)
            if self.stage.owns(i)
            else OtherStageLayer(i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.final_norm(config, dtype) if self.stage.is_last else None
        self._cpu_decode: CpuDecodePath | bool | None = False  # False: not looked at yet

    @staticmethod
    def final_norm(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    @staticmethod
    def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states, or on a stage before the last its layers' output.
        ``hidden``: the previous stage's output (on every stage but the first)."""
        if self._cpu_decode is False:  # at the first step, once the weights are in place
            self._cpu_decode = None
            if self.stage.is_whole:
                self._cpu_decode = CpuDecodePath.for_model(self, LlamaDecoderLayer, LlamaAttention)
        if self._cpu_decode is not None:
            decoded = self._cpu_decode.forward(token_ids, positions)
            if decoded is not None:
                return decoded
        if self.stage.is_first:
            hidden = self.embed_tokens(token_ids)  # [T, hidden]
        for layer in self.layers[self.stage.start : self.stage.end]:
            hidden = layer(positions, hidden)
        return self.norm(hidden) if self.stage.is_last else hidden


class LlamaForCausalLM(nn.Module):
    model_class: ClassVar[type[nn.Module]] = LlamaModel
    # Checkpoint projections that live inside one merged parameter here: name -> (ours, shard).
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        stage: PipelineStage | None = None,
    ):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, dtype, stage)
        self.stage = self.model.stage
        self.lm_head = stage_lm_head(config, dtype, self.stage, self.model.embed_tokens)

    def left_out(self, name: str) -> bool:
        """Whether parameter ``name`` is another pipeline stage's (the loader skips it)."""
        return other_stages_parameter(
            name, self.stage, self.config, "model.embed_tokens.", "model.norm."
        )

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, object] | None:
        """Our parameter and part for an MoE checkpoint tensor (None: any other tensor).
        Mixtral's ``block_sparse_moe`` is our ``mlp``."""
        if ".block_sparse_moe.gate." in name:
            return name.replace(".block_sparse_moe.gate.", ".mlp.gate."), None
        return expert_checkpoint_target(name, "mlp")

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flat batch of tokens (``hidden``: the previous
        pipeline stage's, on every stage but the first)."""
        return self.model(token_ids, positions, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()  # [R, vocab]

    def kv_cache_layers(self) -> dict[str, Attention]:
        """Every layer bound to a KV-cache view, by the name its spec carries."""
        layers = [self.model.layers[i] for i in self.stage.layers]
        return {layer.self_attn.attn.layer_name: layer.self_attn.attn for layer in layers}
