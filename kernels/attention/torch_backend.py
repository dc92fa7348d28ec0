"""The torch backend: the fast path on CPUs. No triton.

Decode rows (one new token per request) go to the C kernel in ``kernels.attention.cpu_attention``,
which reads the cache in place. Prefill chunks go, one request at a time, through a gather of
the request's whole pages and ``scaled_dot_product_attention`` (its fused CPU kernel is made
for long queries). Softcap and sinks, which SDPA lacks, and machines without a C compiler take
the torch reference (``kernels.attention.reference``), which also checks both paths in the tests.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionBackend
from kernels.attention.cpu_attention import decode_kernel, paged_decode_attention
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.params import AttentionParams
from kernels.attention.reference import attend_one_request, gather_request_kv, write_kv_reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        if metadata.num_actual_tokens != key.shape[0]:  # padded rows: the reference skips them
            write_kv_reference(key, value, kv_cache, metadata.slot_mapping)
            return
        head_size, head_size_v = key.shape[-1], value.shape[-1]
        kernel_block_size = kv_cache.shape[2]
        slots = metadata.slot_mapping
        blocks, offsets = slots // kernel_block_size, slots % kernel_block_size
        cells = kv_cache[:, : key.shape[1]]  # [B, H, N, C], a view of the cache
        cells[blocks, :, offsets, :head_size] = key.to(kv_cache.dtype)
        cells[blocks, :, offsets, head_size : head_size + head_size_v] = value.to(kv_cache.dtype)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        params: AttentionParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_q_heads, head_size = query.shape[1:]
        head_size_v = params.resolve_head_size_v(head_size)
        if out is None:
            out = query.new_empty((query.shape[0], num_q_heads, head_size_v))
        starts = metadata.query_start_loc_cpu
        lens = [end - start for start, end in itertools.pairwise(starts)]
        decode = [i for i, n in enumerate(lens) if n == 1]
        if decode and query.device.type == "cpu" and decode_kernel() is not None:
            _decode_rows(query, kv_cache, metadata, params, out, decode)
            done = set(decode)
        else:
            done = set()
        for i, n in enumerate(lens):
            if n == 0 or i in done:
                continue
            rows = slice(starts[i], starts[i + 1])
            out[rows] = _attend_request(query[rows], kv_cache, metadata, params, i)
        return out


def _decode_rows(query, kv_cache, metadata, params, out, requests: list[int]) -> None:
    """The C kernel over the given one-token requests; it reads and writes fp32 rows."""
    every = len(requests) == metadata.num_reqs
    index = None if every else torch.tensor(requests, dtype=torch.int64, device="cpu")
    block_table = metadata.block_table if every else metadata.block_table[index]
    seq_lens = metadata.seq_lens if every else metadata.seq_lens[index]
    token_of = metadata.query_start_loc[:-1] if every else metadata.query_start_loc[index]
    query32 = query.float().contiguous()
    is_direct = out.dtype == torch.float32 and out.is_contiguous()
    out32 = out if is_direct else torch.empty(out.shape, dtype=torch.float32, device="cpu")
    paged_decode_attention(
        query32,
        kv_cache,
        block_table.contiguous(),
        seq_lens.contiguous(),
        token_of.contiguous(),
        metadata.block_size,
        params,
        out32,
    )
    if not is_direct:
        rows = token_of.to(torch.int64)
        out[rows] = out32[rows].to(out.dtype)


def _attend_request(query, kv_cache, metadata, params, index: int) -> torch.Tensor:
    """One request's new tokens ``[Q, Hq, D]`` over its cache: SDPA on its gathered pages."""
    seq_len = metadata.seq_lens_cpu[index]
    block_row = metadata.block_table[index]
    if params.softcap is not None or params.sinks is not None:
        cells = gather_request_kv(
            kv_cache, block_row, seq_len, metadata.block_size, params.num_kv_heads
        )
        head_size = query.shape[-1]
        key = cells[..., :head_size].float()
        value = cells[..., head_size : head_size + params.resolve_head_size_v(head_size)]
        return attend_one_request(query.float(), key, value.float(), params).to(query.dtype)
    cells = _gather_pages(kv_cache, block_row, seq_len, metadata.block_size, params.num_kv_heads)
    head_size = query.shape[-1]
    key = cells[..., :head_size].transpose(0, 1)  # [S, H, D] -> [H, S, D]
    value = cells[..., head_size : head_size + params.resolve_head_size_v(head_size)]
    value = value.transpose(0, 1)
    query_len = query.shape[0]
    if query_len == seq_len and params.sliding_window is None:
        visible, is_causal = None, True  # a whole prompt: SDPA's fused causal kernel
    else:
        # The queries are the last query_len positions: causal from the bottom right.
        query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible, is_causal = key_pos <= query_pos, False  # [Q, S]
        if params.sliding_window is not None:
            visible &= key_pos > query_pos - params.sliding_window
    # Four dimensions (a batch of one): SDPA's fused CPU kernel takes no fewer.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).float()[None],  # [1, Hq, Q, D]
        key.float()[None],
        value.float()[None],
        attn_mask=visible,
        is_causal=is_causal,
        scale=params.scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(query.dtype)  # [Q, Hq, Dv]


def _gather_pages(kv_cache, block_row, seq_len: int, block_size: int, num_kv_heads: int):
    """One request's cells for positions ``0 .. seq_len - 1`` as ``[seq_len, H, C]``, copied
    page by page (whole kernel blocks, not token by token)."""
    kernel_block_size = kv_cache.shape[2]
    per_block = block_size // kernel_block_size  # kernel blocks in one manager block
    num_blocks = -(-seq_len // block_size)
    blocks = block_row[:num_blocks].to(device=kv_cache.device, dtype=torch.int64)
    kernel_blocks = blocks[:, None] * per_block + torch.arange(per_block, device=blocks.device)
    pages = kv_cache.index_select(0, kernel_blocks.reshape(-1))  # [n, H, N, C]
    pages = pages[:, :num_kv_heads].transpose(1, 2)  # [n, N, H, C]
    return pages.reshape(-1, num_kv_heads, kv_cache.shape[3])[:seq_len]
