"""Tiny caches and batches shared by the kernel tests.

A cache is a real kvcore allocation: two layers in one raw byte buffer, laid out by the given
layout, and the test works on the second layer so that a wrong layer stride shows. A batch's
requests get disjoint, shuffled block ids, so a wrong block-table lookup reads someone else's
keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvcore
from kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from kernels.attention.params import AttentionParams
from kernels.attention.reference import dense_attention_float64, write_kv_reference

# Compiled kernels on a GPU; the Triton interpreter (see conftest.py) on a CPU.
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Relative error bounds of the issue, per cache dtype.
TOLERANCES = {"bfloat16": 2e-2, "float32": 1e-4}
LAYER_NAMES = ["layer.0", "layer.1"]


@dataclass
class Cache:
    raw: torch.Tensor  # the flat int8 buffer under every layer
    view: torch.Tensor  # [B, H, N, C] of LAYER_NAMES[1]
    spec: kvcore.FullAttentionSpec
    tensor: kvcore.KVCacheTensor
    num_blocks: int  # manager blocks


def make_cache(
    layout: str,
    spec: kvcore.FullAttentionSpec,
    num_blocks: int,
    kernel_block_size: int | None = None,
    layer_names: list[str] = LAYER_NAMES,
) -> Cache:
    tensor = kvcore.build_kv_cache_tensor(spec, layer_names, num_blocks, layout)
    raw = torch.zeros(tensor.size, dtype=torch.int8, device=DEVICE)
    views = kvcore.create_kv_cache_views(
        raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel_block_size
    )
    return Cache(raw, views[layer_names[-1]], spec, tensor, num_blocks)


@dataclass(frozen=True)
class Request:
    query_len: int
    seq_len: int


# Request shapes: a fresh prefill, a chunked prefill over a cached prefix, and decodes. Long
# ones span two 32-key tiles, and a window of 13 makes the kernel skip a whole tile of them.
# The fresh prefill is longer than one program's query tile (16, 4 or 2 tokens by grouping).
FRESH_PREFILL = Request(query_len=19, seq_len=19)
CHUNKED_PREFILL = Request(query_len=12, seq_len=45)
SHORT_DECODE = Request(query_len=1, seq_len=9)
LONG_DECODE = Request(query_len=1, seq_len=60)
MID_DECODE = Request(query_len=1, seq_len=37)
BATCHES = {
    "prefill": [FRESH_PREFILL, CHUNKED_PREFILL],
    "decode": [SHORT_DECODE, LONG_DECODE, MID_DECODE],
    "mixed": [LONG_DECODE, CHUNKED_PREFILL, SHORT_DECODE],
}
WINDOW = 13


@dataclass
class Batch:
    metadata: AttentionMetadata
    query: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per request [S, Hkv, D], exactly as stored in the cache
    values: list[torch.Tensor]  # per request [S, Hkv, Dv]


def blocks_needed(requests: list[Request], block_size: int) -> int:
    return sum(-(-r.seq_len // block_size) for r in requests)


def make_batch(
    cache: Cache,
    requests: list[Request],
    num_q_heads: int,
    generator: torch.Generator,
) -> Batch:
    """Random Q for each request's new tokens; random K/V for its whole sequence, written into
    ``cache`` with the reference writer through a full-prefill slot mapping."""
    spec, dtype = cache.spec, cache.view.dtype
    block_size = spec.block_size
    block_ids = torch.randperm(cache.num_blocks, generator=generator).tolist()
    tables = []
    for request in requests:
        num = -(-request.seq_len // block_size)
        tables.append(block_ids[:num])
        block_ids = block_ids[num:]
    seq_lens = [r.seq_len for r in requests]
    whole = build_attention_metadata(seq_lens, seq_lens, tables, block_size, DEVICE)
    num_tokens = sum(seq_lens)
    key = randn((num_tokens, spec.num_kv_heads, spec.head_size), dtype, generator)
    value = randn((num_tokens, spec.num_kv_heads, spec.head_size_v), dtype, generator)
    write_kv_reference(key, value, cache.view, whole.slot_mapping)
    query_lens = [r.query_len for r in requests]
    metadata = build_attention_metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    query = randn((sum(query_lens), num_q_heads, spec.head_size), dtype, generator)
    bounds = whole.query_start_loc_cpu
    keys = [key[bounds[i] : bounds[i + 1]] for i in range(len(requests))]
    values = [value[bounds[i] : bounds[i + 1]] for i in range(len(requests))]
    return Batch(metadata, query, keys, values)


def dense_outputs(batch: Batch, params: AttentionParams) -> torch.Tensor:
    """Each request's attention by the dense float64 oracle, concatenated ``[T, Hq, Dv]``."""
    starts = batch.metadata.query_start_loc_cpu
    outs = [
        dense_attention_float64(batch.query[starts[i] : starts[i + 1]], key, value, params)
        for i, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True))
    ]
    return torch.cat(outs)  # [T, Hq, Dv]


def randn(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Drawn on the CPU (one generator for every device), then moved to DEVICE."""
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(DEVICE, dtype)


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer whose every element fails the checks unless a kernel overwrote it."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|; NaN anywhere (an unwritten element) is inf."""
    actual = actual.detach().cpu().double()
    if not torch.isfinite(actual).all():
        return float("inf")
    expected = expected.detach().cpu().double()
    return float((actual - expected).abs().max() / expected.abs().max())


def strided_state(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``[S, ...]`` view into an int8 buffer, as kvcore's views are: slots two slots plus 16
    bytes apart (another layer's state between them), starting 16 bytes in, and rows of the
    last (contiguous) dim padded by 2 elements."""
    *outer, rows, cols = shape
    row_stride = cols + 2
    inner = [row_stride * rows] if outer[1:] else []
    slot_elems = (outer[1] if outer[1:] else 1) * row_stride * rows
    pad = 16 // dtype.itemsize
    slot_stride = 2 * slot_elems + pad
    raw = torch.zeros((shape[0] * slot_stride + pad) * dtype.itemsize, dtype=torch.int8,
                      device=DEVICE)  # fmt: skip
    strides = (slot_stride, *inner, row_stride, 1)
    return raw.view(dtype).as_strided(shape, strides, pad)
