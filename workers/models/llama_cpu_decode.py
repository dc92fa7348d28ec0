"""Short steps of a Llama-family model on CPUs through the C decoder-layer kernels
(``kernels.decoder.cpu_decoder``), where the torch modules dispatch some seventy small ops per
layer, which on two cores cost half of SmolLM2's decode step.

Two forms. With the four projections of every layer held as GGUF blocks, a layer is two C
calls (each block's projections inside them), for steps of up to 32 tokens. With any other
weights (float32, oneDNN-packed, or a mix), the projections run as the modules run them and
the glue between them is C: the residual add and norm, the rotary embedding, the cache write
and the attention in one call, SiLU(gate) * up in another. That form takes decode steps of up
to 256 requests (a batch of ``embedded:20m`` decode rows spent a third of its step in the
small ops) and other steps of up to 32 tokens.

A step with several new tokens per request (speculative verification, a short prefill chunk)
is read by the decode kernel as one request per token. The layers must be plain Llama layers
(gated SiLU MLP, no Q/K norms, no sinks or softcap, one sliding window for all, no bias on the
row-parallel projections), the activations and norms float32, the cache float32, float16 or
bfloat16, and every layer in one KV-cache group served by the torch backend. Any other step
goes through the modules, as does a model that never qualifies. A tensor-parallel rank
all-reduces each block's output between the calls, as the row-parallel layers do.
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
    attention_threads,
)
from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.decoder import cpu_decoder
from kernels.quant import cpu_matmul
from kernels.quant.gguf_blocks import QuantizedMatrix
from workers.forward_context import get_forward_context
from workers.layers.cpu_matmul import linear
from workers.layers.mlp import MLP
from workers.parallel import all_reduce, get_tp_group

FUSED_MAX_ROWS = cpu_matmul.KERNEL_MAX_ROWS  # past it the modules' prefill-sized matmuls win
GLUE_MAX_ROWS = 32  # a step with more tokens than requests, past it the prefill kernel wins
GLUE_MAX_DECODE_ROWS = 256


@dataclass
class _Buffers:
    """Scratch for steps of up to ``capacity`` rows; a step of fewer uses the first rows."""

    capacity: int
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
        return {f.name: getattr(self, f.name).data_ptr() for f in fields(self)[1:]}


@dataclass(frozen=True)
class _Projections:
    """One layer's four projections as ``workers.layers.cpu_matmul.linear`` takes them:
    (weight, packed weight, bias)."""

    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple

    @classmethod
    def of(cls, layer: nn.Module) -> _Projections:
        return cls(*((p.weight, p.packed_weight, p.bias) for p in _projection_modules(layer)))


class CpuDecodePath:
    """Built once a model's weights are loaded; ``forward`` returns None for a step it does
    not take."""

    def __init__(self, model: nn.Module, library, *, fused: bool):
        self.model = model
        self.library = library
        self.fused = fused  # GGUF blocks multiplied inside the C blocks
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
        self.intermediate = layers[0].mlp.down_proj.input_size_per_rank
        self.projections = [_Projections.of(layer) for layer in layers]
        self.decoder_model = self._decoder_model(layers[0].input_layernorm.eps)
        self._caches: tuple | None = None  # the cache views the layer structures point into
        # One C array of the layer structures: iterated layer by layer, or handed whole to
        # ``decoder_layers``.
        self._layers = (cpu_decoder.DecoderLayer * 0)()
        self._buffers: _Buffers | None = None
        self.num_steps = 0  # steps taken here (the tests check it moves)

    def _decoder_model(self, eps: float) -> cpu_decoder.DecoderModel:
        matmuls = cpu_matmul.kernel()
        use_int16 = cpu_matmul.has_int16_path()
        return cpu_decoder.DecoderModel(
            hidden=self.hidden,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            intermediate=self.intermediate,
            eps=eps,
            matmul=cpu_decoder.entry_point(matmuls.gguf_matmul),
            matmul_int16=cpu_decoder.entry_point(matmuls.gguf_matmul_int16) if use_int16 else None,
            int16_max_rows=cpu_matmul.int16_max_rows(),
            attention=cpu_decoder.entry_point(cpu_decoder.decode_kernel()),
        )

    @classmethod
    def for_model(
        cls, model: nn.Module, layer_class: type, attention_class: type
    ) -> CpuDecodePath | None:
        """The path for a loaded ``LlamaModel`` whose layers are exactly ``layer_class`` with
        ``attention_class`` (not a subclass, which may compute something else), or None where
        it can never take a step."""
        layers = list(getattr(model, "layers", ()))
        embeddings = model.embed_tokens.weight
        if not layers or embeddings.device.type != "cpu" or embeddings.dtype != torch.float32:
            return None
        kinds = set()
        for layer in layers:
            if type(layer) is not layer_class or type(layer.self_attn) is not attention_class:
                return None
            if not _plain_llama_layer(layer, layers[0]):
                return None
            kinds.update(_projection_kinds(layer))
        if None in kinds:
            return None
        first = layers[0].self_attn.attn
        head_size = first.head_size
        group = first.num_heads // first.num_kv_heads
        if head_size % 2 or head_size > MAX_HEAD or group > MAX_GROUP:
            return None
        library = cpu_decoder.decoder_library()
        return None if library is None else cls(model, library, fused=kinds == {"gguf"})

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
        if self.fused:
            self._fused_layers(model, decoder_step, buffers)
        else:  # the last block's output stays referenced until the final norm has read it
            held = (*held, self._glue_layers(model, decoder_step, buffers))
        decoder_step.normed = out.data_ptr()
        final = self.model.norm.weight
        _check(self.library.residual_norm(model, final.data_ptr(), step_ref), "final norm")
        del held
        self.num_steps += 1
        return out

    def _fused_layers(self, model, step: cpu_decoder.DecoderStep, buffers: _Buffers) -> None:
        step_ref, layers = ctypes.byref(step), self._layers
        if get_tp_group().world_size == 1:  # nothing to all-reduce: every layer in one call
            _check(self.library.decoder_layers(model, layers, len(layers), step_ref), "layers")
            return
        delta = buffers.delta[: step.rows]
        for layer in layers:
            layer_ref = ctypes.byref(layer)
            _check(self.library.attention_block(model, layer_ref, step_ref), "attention")
            all_reduce(delta)
            _check(self.library.mlp_block(model, layer_ref, step_ref), "MLP")
            all_reduce(delta)

    def _glue_layers(self, model, step: cpu_decoder.DecoderStep, buffers: _Buffers) -> torch.Tensor:
        """The projections through torch (oneDNN for float32), the rest in C. Each output is
        kept referenced until the C call after it has read it; the last one is returned."""
        library, step_ref, rows = self.library, ctypes.byref(step), step.rows
        normed, attended = buffers.normed[:rows], buffers.attended[:rows]
        activated = buffers.activated[:rows]
        for layer, weights in zip(self._layers, self.projections, strict=True):
            layer_ref = ctypes.byref(layer)
            _check(library.residual_norm(model, layer.input_norm, step_ref), "norm")
            qkv = linear(normed, *weights.qkv)
            step.qkv = qkv.data_ptr()
            _check(library.attend(model, layer_ref, step_ref), "attention")
            delta = all_reduce(linear(attended, *weights.o))
            step.delta, step.has_delta = delta.data_ptr(), 1
            _check(library.residual_norm(model, layer.post_norm, step_ref), "norm")
            gate_up = linear(normed, *weights.gate_up)
            step.gate_up = gate_up.data_ptr()
            _check(library.gated_silu(model, step_ref), "SiLU")
            delta = all_reduce(linear(activated, *weights.down))
            step.delta, step.has_delta = delta.data_ptr(), 1
        return delta

    def _metadata_if_taken(self, token_ids: torch.Tensor):
        """The step's attention metadata when this path takes the step, else None."""
        num_rows = token_ids.shape[0]
        if num_rows < 1 or token_ids.device.type != "cpu":
            return None
        context = get_forward_context()
        step = context.step_for(self.layer_names[0])
        if not isinstance(step.kernels, TorchAttentionBackend):
            return None
        metadata = step.metadata
        if num_rows > self._max_rows(metadata.is_decode_only):
            return None
        if metadata.num_actual_tokens != num_rows:  # padded
            return None
        if any(context.step_for(name) is not step for name in self.layer_names):
            return None
        return metadata if self._bind_caches() else None

    def _max_rows(self, decode_only: bool) -> int:
        if self.fused:
            return FUSED_MAX_ROWS
        return GLUE_MAX_DECODE_ROWS if decode_only else GLUE_MAX_ROWS

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
            sliding_window=self.params.sliding_window or 0,
            scale=self.params.scale,
            softcap=0.0,
        )
        decoder_step = cpu_decoder.DecoderStep(
            rows=hidden.shape[0],
            residual=hidden.data_ptr(),
            has_delta=0,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=slots.data_ptr(),
            attention=attention,
            num_items=seq_lens.shape[0] * self.num_kv_heads,
            num_threads=attention_threads(),
            **buffers.pointers,
        )
        return decoder_step, (cos, sin, slots, block_table, seq_lens, token_of)

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
        structs = [self._layer_struct(layer, cache, self.fused) for layer, cache in pairs]
        self._layers = (cpu_decoder.DecoderLayer * len(structs))(*structs)
        self._caches = caches
        return True

    @staticmethod
    def _layer_struct(
        layer: nn.Module, cache: torch.Tensor, fused: bool
    ) -> cpu_decoder.DecoderLayer:
        """The layer's structure; its weights only where the C blocks multiply them."""
        attention, mlp = layer.self_attn, layer.mlp
        qkv = attention.qkv_proj
        weights = {}
        if fused:
            weights = dict(
                qkv=cpu_decoder.qweight(qkv.packed_weight, qkv.bias),
                o=cpu_decoder.qweight(attention.o_proj.packed_weight),
                gate_up=cpu_decoder.qweight(mlp.gate_up_proj.packed_weight),
                down=cpu_decoder.qweight(mlp.down_proj.packed_weight),
            )
        return cpu_decoder.DecoderLayer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_norm=layer.post_attention_layernorm.weight.data_ptr(),
            **weights,
            cache=cache.data_ptr(),
            stride_cb=cache.stride(0),
            stride_ch=cache.stride(1),
            stride_cn=cache.stride(2),
            kernel_block_size=cache.shape[2],
            cache_dtype=DTYPE_CODES[cache.dtype],
        )

    def _buffers_for(self, num_rows: int) -> _Buffers:
        """Scratch for ``num_rows``, grown to the next power of two when a step needs more
        (one set whatever the batch: a set per row count would hold hundreds)."""
        buffers = self._buffers
        if buffers is None or buffers.capacity < num_rows:
            capacity = 1 << (num_rows - 1).bit_length()

            def rows(width: int) -> torch.Tensor:
                return torch.empty(capacity, width, dtype=torch.float32, device="cpu")

            buffers = _Buffers(
                capacity=capacity,
                delta=rows(self.hidden),
                normed=rows(self.hidden),
                qkv=rows(self.qkv_width),
                query=rows(self.q_width),
                attended=rows(self.q_width),
                gate_up=rows(2 * self.intermediate),
                activated=rows(self.intermediate),
            )
            self._buffers = buffers
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
    rows = torch.tensor(request_of, dtype=torch.int64, device="cpu")
    block_table = metadata.block_table.index_select(0, rows).contiguous()
    num_tokens = len(request_of)
    return (
        block_table,
        torch.tensor(seq_lens, dtype=torch.int32, device="cpu"),
        torch.arange(num_tokens, dtype=torch.int32, device="cpu"),
    )


def _check(code: int, part: str) -> None:
    if code != 0:
        raise RuntimeError(f"the CPU decoder kernel's {part} block failed with code {code}")


def _plain_llama_layer(layer: nn.Module, first: nn.Module) -> bool:
    """A layer the C glue computes as the modules do, sharing the first layer's attention
    settings and rotary embedding."""
    attention, mlp = layer.self_attn, layer.mlp
    if attention.q_norm is not None or attention.rotary_emb.is_interleaved:
        return False
    if not isinstance(mlp, MLP) or mlp.gate_up_proj is None or mlp.activation != "silu":
        return False
    if attention.o_proj.bias is not None or mlp.down_proj.bias is not None:
        return False  # added after the all-reduce, which the C blocks do not do
    params = attention.attn.params
    if params.sinks is not None or params.softcap is not None:
        return False
    if params != first.self_attn.attn.params:
        return False
    if attention.rotary_emb is not first.self_attn.rotary_emb:
        return False
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return all(n.dtype == torch.float32 and n.is_contiguous() for n in norms)


def _projection_modules(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A layer's four projections, in the order of ``_Projections``' fields."""
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def _projection_kinds(layer: nn.Module) -> list[str | None]:
    """Per projection: "gguf" (blocks), "float" (float32, oneDNN-packed or not), or None."""
    kinds = []
    for projection in _projection_modules(layer):
        packed = projection.packed_weight
        if isinstance(packed, QuantizedMatrix):
            kinds.append("gguf")
            continue
        weight = projection.weight if packed is None else packed
        bias = projection.bias
        floats = weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
        kinds.append("float" if floats and weight.device.type == "cpu" else None)
    return kinds
