"""Short steps of a Llama-family model on CPUs through the C decoder-layer kernels
(``kernels.decoder.cpu_decoder``): two calls per layer where the torch modules dispatch some
seventy small ops, which on two cores cost half of SmolLM2's decode step.

It takes a step of up to 32 tokens (no padding) when the C kernels compute what the modules
would: decode steps, and steps with several tokens per request (speculative verification,
short prefill chunks), whose tokens the decode kernel reads as requests of their own. The
layers must be plain Llama layers (gated SiLU MLP, no Q/K norms, no sinks or softcap, one
sliding window for all), their four projections held as GGUF blocks, the cache float32,
float16 or bfloat16, and every layer in one KV-cache group served by the torch backend. Any
other step goes through the modules, as does a model that never qualifies. A tensor-parallel
rank all-reduces each block's output between the calls, as the row-parallel layers do.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, fields

import torch
from torch import nn

from kernels.attention.cpu_attention import (
    DTYPE_CODES,
    MAX_GROUP,
    MAX_HEAD,
    DecodeArgs,
    _work_split,
)
from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.decoder import cpu_decoder
from kernels.quant import cpu_matmul
from kernels.quant.gguf_blocks import QuantizedMatrix
from workers.forward_context import get_forward_context
from workers.layers.mlp import MLP
from workers.parallel import all_reduce

MAX_ROWS = cpu_matmul.KERNEL_MAX_ROWS  # past it the modules' prefill-sized matmuls win


@dataclass
class _Buffers:
    """One step's scratch, kept per row count (a decode batch keeps its size for a while)."""

    delta: torch.Tensor
    normed: torch.Tensor
    qkv: torch.Tensor
    query: torch.Tensor
    attended: torch.Tensor
    gate_up: torch.Tensor
    activated: torch.Tensor

    @functools.cached_property
    def pointers(self) -> dict[str, int]:
        """Each buffer's address by its name, which is the step structure's field name."""
        return {f.name: getattr(self, f.name).data_ptr() for f in fields(self)}


class CpuDecodePath:
    """Built once a model's weights are loaded; ``forward`` returns None for a step it does
    not take."""

    def __init__(self, model: nn.Module, library):
        self.model = model
        self.library = library
        layers = model.layers
        first = layers[0].self_attn
        self.rotary = first.rotary_emb
        self.attentions = [layer.self_attn.attn for layer in layers]
        self.layer_names = [attention.layer_name for attention in self.attentions]
        self.params = first.attn.params
        self.num_heads, self.num_kv_heads = first.attn.num_heads, first.attn.num_kv_heads
        self.head_size = first.attn.head_size
        self.q_width = self.num_heads * self.head_size
        self.qkv_width = first.qkv_proj.output_size_per_rank
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        self.intermediate = layers[0].mlp.down_proj.packed_weight.shape[1]
        matmuls = cpu_matmul.kernel()
        use_int16 = cpu_matmul.has_int16_path()
        self.decoder_model = cpu_decoder.DecoderModel(
            hidden=self.hidden,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            intermediate=self.intermediate,
            eps=layers[0].input_layernorm.eps,
            matmul=cpu_decoder.entry_point(matmuls.gguf_matmul),
            matmul_int16=cpu_decoder.entry_point(matmuls.gguf_matmul_int16) if use_int16 else None,
            int16_max_rows=cpu_matmul.int16_max_rows(),
            attention=cpu_decoder.entry_point(cpu_decoder.decode_kernel()),
        )
        self._caches: tuple | None = None  # the cache views the layer structures point into
        self._layers: list[cpu_decoder.DecoderLayer] = []
        self._buffers: dict[int, _Buffers] = {}
        self.num_steps = 0  # steps taken here (the tests check it moves)

    @classmethod
    def for_model(
        cls, model: nn.Module, layer_class: type, attention_class: type
    ) -> CpuDecodePath | None:
        """The path for a loaded ``LlamaModel`` whose layers are exactly ``layer_class`` with
        ``attention_class`` (not a subclass, which may compute something else), or None where
        it can never take a step."""
        layers = list(getattr(model, "layers", ()))
        if not layers or model.embed_tokens.weight.device.type != "cpu":
            return None
        for layer in layers:
            if type(layer) is not layer_class or type(layer.self_attn) is not attention_class:
                return None
            attention, mlp = layer.self_attn, layer.mlp
            if attention.q_norm is not None or attention.rotary_emb.is_interleaved:
                return None
            if not isinstance(mlp, MLP) or mlp.gate_up_proj is None or mlp.activation != "silu":
                return None
            projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(p.packed_weight, QuantizedMatrix) for p in projections):
                return None
            if any(p.bias is not None for p in projections[1:]):  # row-parallel sums first
                return None
            params = attention.attn.params
            if params.sinks is not None or params.softcap is not None:
                return None
            if params != layers[0].self_attn.attn.params or attention.rotary_emb is not (
                layers[0].self_attn.rotary_emb
            ):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(n.dtype != torch.float32 or not n.is_contiguous() for n in norms):
                return None
        first = layers[0].self_attn.attn
        head_size = first.head_size
        group = first.num_heads // first.num_kv_heads
        if head_size % 2 or head_size > MAX_HEAD or group > MAX_GROUP:
            return None
        library = cpu_decoder.decoder_library()
        return None if library is None else cls(model, library)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        metadata = self._metadata_if_taken(token_ids)
        if metadata is None:
            return None
        hidden = self.model.embed_tokens(token_ids)
        if hidden.dtype != torch.float32 or not hidden.is_contiguous():
            return None
        buffers = self._buffers_for(token_ids.shape[0])
        out = torch.empty_like(hidden)
        # The tensors the structure points into live as long as ``held``.
        decoder_step, held = self._decoder_step(hidden, positions, metadata, buffers)
        model, step_ref = ctypes.byref(self.decoder_model), ctypes.byref(decoder_step)
        for layer in self._layers:
            layer_ref = ctypes.byref(layer)
            _check(self.library.attention_block(model, layer_ref, step_ref), "attention")
            all_reduce(buffers.delta)
            _check(self.library.mlp_block(model, layer_ref, step_ref), "MLP")
            all_reduce(buffers.delta)
        decoder_step.normed = out.data_ptr()
        final = self.model.norm.weight
        _check(self.library.final_norm(model, final.data_ptr(), step_ref), "final norm")
        del held
        self.num_steps += 1
        return out

    def _metadata_if_taken(self, token_ids: torch.Tensor):
        """The step's attention metadata when this path takes the step, else None."""
        num_rows = token_ids.shape[0]
        if not 1 <= num_rows <= MAX_ROWS or token_ids.device.type != "cpu":
            return None
        context = get_forward_context()
        step = context.step_for(self.layer_names[0])
        if not isinstance(step.kernels, TorchAttentionBackend):
            return None
        if step.metadata.num_actual_tokens != num_rows:  # padded
            return None
        if any(context.step_for(name) is not step for name in self.layer_names):
            return None
        return step.metadata if self._bind_caches() else None

    def _decoder_step(self, hidden, positions, metadata, buffers: _Buffers):
        """The C structure for one step, and the tensors it points into."""
        cos, sin = self.rotary._cos_sin(positions)
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = metadata.slot_mapping.contiguous()
        if metadata.is_decode_only:
            block_table = metadata.block_table.contiguous()
            seq_lens = metadata.seq_lens.contiguous()
            token_of = metadata.query_start_loc[:-1].contiguous()
        else:
            block_table, seq_lens, token_of = _one_request_per_token(metadata)
        window = self.params.sliding_window
        items, bounds, num_threads = _work_split(seq_lens, self.num_kv_heads, window)
        attention = DecodeArgs(
            dtype=0,
            block_table=block_table.data_ptr(),
            stride_bt=block_table.stride(0),
            seq_lens=seq_lens.data_ptr(),
            token_of=token_of.data_ptr(),
            num_q_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size,
            block_size=metadata.block_size,
            sliding_window=window or 0,
            scale=self.params.scale,
            softcap=0.0,
            items=items.data_ptr(),
        )
        decoder_step = cpu_decoder.DecoderStep(
            rows=hidden.shape[0],
            residual=hidden.data_ptr(),
            has_delta=0,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=slots.data_ptr(),
            attention=attention,
            bounds=bounds.data_ptr(),
            num_threads=num_threads,
            **buffers.pointers,
        )
        return decoder_step, (cos, sin, slots, block_table, seq_lens, token_of, items, bounds)

    def _bind_caches(self) -> bool:
        """Point the layer structures at the layers' cache views (again after a rebind)."""
        layers = self.model.layers
        caches = tuple(attention.kv_cache for attention in self.attentions)
        if self._caches is not None and all(
            a is b for a, b in zip(caches, self._caches, strict=True)
        ):
            return True
        if any(c is None or c.dtype not in DTYPE_CODES or c.stride(-1) != 1 for c in caches):
            return False
        if any(c.shape[1] < self.num_kv_heads or c.shape[3] < 2 * self.head_size for c in caches):
            return False
        pairs = zip(layers, caches, strict=True)
        self._layers = [self._layer_struct(layer, cache) for layer, cache in pairs]
        self._caches = caches
        return True

    @staticmethod
    def _layer_struct(layer: nn.Module, cache: torch.Tensor) -> cpu_decoder.DecoderLayer:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = attention.qkv_proj
        return cpu_decoder.DecoderLayer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_norm=layer.post_attention_layernorm.weight.data_ptr(),
            qkv=cpu_decoder.qweight(qkv.packed_weight, qkv.bias),
            o=cpu_decoder.qweight(attention.o_proj.packed_weight),
            gate_up=cpu_decoder.qweight(mlp.gate_up_proj.packed_weight),
            down=cpu_decoder.qweight(mlp.down_proj.packed_weight),
            cache=cache.data_ptr(),
            stride_cb=cache.stride(0),
            stride_ch=cache.stride(1),
            stride_cn=cache.stride(2),
            kernel_block_size=cache.shape[2],
            cache_dtype=DTYPE_CODES[cache.dtype],
        )

    def _buffers_for(self, num_rows: int) -> _Buffers:
        buffers = self._buffers.get(num_rows)
        if buffers is None:

            def rows(width: int) -> torch.Tensor:
                return torch.empty(num_rows, width, dtype=torch.float32)

            buffers = _Buffers(
                delta=rows(self.hidden),
                normed=rows(self.hidden),
                qkv=rows(self.qkv_width),
                query=rows(self.q_width),
                attended=rows(self.q_width),
                gate_up=rows(2 * self.intermediate),
                activated=rows(self.intermediate),
            )
            self._buffers[num_rows] = buffers
        return buffers


def _one_request_per_token(metadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step with several new tokens per request (a speculative verification, a short
    prefill chunk) as the decode kernel reads it: each token a request of its own, with its
    request's block table row and the keys up to and including itself (the causal mask)."""
    starts, totals = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    request_of: list[int] = []
    seq_lens: list[int] = []
    for request, total in enumerate(totals):
        num_new = starts[request + 1] - starts[request]
        request_of += [request] * num_new
        seq_lens += range(total - num_new + 1, total + 1)
    rows = torch.tensor(request_of, dtype=torch.int64)
    block_table = metadata.block_table.index_select(0, rows).contiguous()
    num_tokens = len(request_of)
    return (
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.arange(num_tokens, dtype=torch.int32),
    )


def _check(code: int, part: str) -> None:
    if code != 0:
        raise RuntimeError(f"the CPU decoder kernel's {part} block failed with code {code}")
