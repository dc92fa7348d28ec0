"""NemotronH: a hybrid of Mamba-2 (``M``), attention without RoPE (``*``), relu² MLP (``-``)
and mixture-of-experts (``E``: routed relu² experts and a shared one, ``workers.layers.moe``)
layers, one mixer per layer behind a pre-RMSNorm and a residual. Each Mamba layer keeps its conv
and SSM states in the KV cache (one ``MambaSpec`` page per request), each attention layer its
K/V, exactly as a Llama layer does."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from workers.kinds.attention import attention_layer_name
from workers.kinds.mamba import mamba_layer_name
from workers.layers.attention import Attention
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import QKVParallelLinear, RowParallelLinear
from workers.layers.mamba2 import MambaMixer2
from workers.layers.missing import OtherStageLayer
from workers.layers.mlp import MLP
from workers.layers.moe import SparseMoE, expert_checkpoint_target
from workers.layers.norm import RMSNorm
from workers.model_config import ModelConfig
from workers.models.stage_parts import other_stages_parameter, stage_lm_head
from workers.stages import PipelineStage


class NemotronHAttention(nn.Module):
    """Attention with no rotary embedding and no biases (positions come from the Mamba
    layers)."""

    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=False,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias=False, dtype=dtype
        )
        self.attn = Attention(
            attention_layer_name(layer_index, config.attention_module),
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens, head_dim = hidden.shape[0], self.attn.head_size
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.attn.num_heads, head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.attn.num_kv_heads, head_dim)  # [T, Hk, D]
        v = v.view(num_tokens, self.attn.num_kv_heads, head_dim)
        return self.o_proj(self.attn(q, k, v))


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype):
        super().__init__()
        self.kind = config.layer_types[layer_index]
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=True
        )
        if self.kind == "mamba":
            self.mixer = MambaMixer2(
                mamba_layer_name(layer_index),
                config.hidden_size,
                config.mamba,
                config.rms_norm_eps,
                dtype,
            )
        elif self.kind == "full_attention":
            self.mixer = NemotronHAttention(config, layer_index, dtype)
        elif config.is_moe(layer_index):
            self.mixer = SparseMoE(config.hidden_size, config.moe, dtype)
        else:
            self.mixer = MLP(
                config.hidden_size, config.intermediate_size, gated=False, activation="relu2",
                bias=config.mlp_bias, dtype=dtype,
            )  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden))


class NemotronHModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, stage: PipelineStage | None = None):
        super().__init__()
        self.stage = stage or PipelineStage.whole(config.num_hidden_layers)
        self.embeddings = None
        if self.stage.holds_embedding(config.tie_word_embeddings):
            self.embeddings = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, dtype=dtype
            )
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, dtype) if self.stage.owns(i) else OtherStageLayer(i)
            for i in range(config.num_hidden_layers)
        )
        self.norm_f = None
        if self.stage.is_last:
            self.norm_f = RMSNorm(
                config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=True
            )

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.stage.is_first:
            hidden = self.embeddings(token_ids)  # [T, hidden]
        for layer in self.layers[self.stage.start : self.stage.end]:
            hidden = layer(hidden)
        return self.norm_f(hidden) if self.stage.is_last else hidden


class NemotronHForCausalLM(nn.Module):
    # Checkpoint projections that live inside one merged parameter here: name -> (ours, shard).
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        stage: PipelineStage | None = None,
    ):
        super().__init__()
        self.config = config
        self.model = NemotronHModel(config, dtype, stage)
        self.stage = self.model.stage
        self.lm_head = stage_lm_head(config, dtype, self.stage, self.model.embeddings)

    def left_out(self, name: str) -> bool:
        """Whether parameter ``name`` is another pipeline stage's (the loader skips it)."""
        return other_stages_parameter(
            name, self.stage, self.config, "model.embeddings.", "model.norm_f."
        )

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Our parameter name for a checkpoint tensor: transformers and published checkpoints
        write ``backbone.`` for our ``model.``, and ``A_log`` for the ``A = -exp(A_log)`` that
        the mixer keeps."""
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        if name.endswith(".mixer.A_log"):
            name = name.removesuffix("A_log") + "A"
        return name

    @classmethod
    def checkpoint_target(cls, name: str) -> tuple[str, object] | None:
        """Our stacked parameter and part for an expert tensor (None: any other tensor)."""
        return expert_checkpoint_target(cls.checkpoint_name(name), "mixer")

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flat batch of tokens (positions unused: no
        layer has a rotary embedding; ``hidden``: the previous pipeline stage's, on every
        stage but the first)."""
        return self.model(token_ids, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden).float()  # [R, vocab]

    def kv_cache_layers(self) -> dict[str, nn.Module]:
        """Every layer bound to a KV-cache view, by the name its spec carries."""
        layers = {}
        for block in (self.model.layers[i] for i in self.stage.layers):
            if block.kind == "mamba":
                layers[block.mixer.layer_name] = block.mixer
            elif block.kind == "full_attention":
                layers[block.mixer.attn.layer_name] = block.mixer.attn
        return layers
