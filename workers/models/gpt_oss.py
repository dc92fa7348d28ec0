"""gpt-oss: Llama's decoder with a learned sink logit per attention head (it joins each
query's softmax and contributes no value, so a head can attend to nothing: every attention
backend takes ``AttentionParams.sinks``), biases on every projection, sliding-window and full
layers alternating, RMSNorms that scale in float32, and a mixture of experts in every layer
(``workers.layers.moe``: the router's top-k logits softmaxed among themselves; experts with
biases and a clamped SwiGLU)."""

from __future__ import annotations

import torch
from torch import nn

from workers.layers.attention import Attention
from workers.layers.moe import expert_checkpoint_target
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding
from workers.model_config import ModelConfig
from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from workers.parallel import get_tp_group


class GptOssAttention(LlamaAttention):
    def __init__(
        self, config: ModelConfig, layer_index: int, dtype: torch.dtype, rotary_emb: RotaryEmbedding
    ):
        super().__init__(config, layer_index, dtype, rotary_emb)
        heads = self.attn.num_heads  # this rank's
        self.sinks = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        attn = self.attn
        self.attn = Attention(
            attn.layer_name, attn.num_heads, attn.num_kv_heads, attn.head_size,
            scale=attn.scale, sliding_window=attn.params.sliding_window, sinks=self.sinks,
        )  # fmt: skip

    def _load_sinks(self, param: nn.Parameter, loaded) -> None:
        """This rank's heads' sinks, from the checkpoint's [num_attention_heads]."""
        heads = param.shape[0]
        if tuple(loaded.shape) != (heads * get_tp_group().world_size,):
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, get_tp_group().rank * heads, heads))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def __init__(self, config, layer_index, dtype, rotary_emb):
        super().__init__(config, layer_index, dtype, rotary_emb)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, scale_in_float32=True)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps, dtype=dtype, scale_in_float32=True
        )


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer

    @staticmethod
    def final_norm(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=True)


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, object] | None:
        """gpt-oss's ``mlp.router`` is our ``mlp.gate``; its experts are stacked."""
        if ".mlp.router." in name:
            return name.replace(".mlp.router.", ".mlp.gate."), None
        return expert_checkpoint_target(name, "mlp")
