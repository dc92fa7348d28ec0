"""Paged decode attention for CPUs: a small C kernel (``kernels/attention/cpu/paged_decode.c``) that
reads the cache in place, called through ctypes.

Decode attention is memory-bound: each step reads every running request's K and V once. In
torch ops it costs a gather (a copy of every page) plus a Python loop of small ops per request,
about ten times what the reads cost. The kernel reads each K and V row once, straight from the
view through its strides, with an online softmax per query head, on a few threads.

The kernel is compiled at first use with the system C compiler (``cc``, or ``$CC``) into the
user's cache directory, keyed by the source and the CPU, so later processes load it at once.
Where there is no compiler, ``decode_kernel()`` is None and callers use the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from kernels.attention.cache_view import check_kv_cache, check_query_heads
from kernels.attention.params import AttentionParams
from kernels.c_build import build_library

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "paged_decode.c"
MAX_HEAD, MAX_GROUP, MAX_THREADS = 512, 64, 256  # as the kernel's stack buffers allow
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class DecodeArgs(ctypes.Structure):
    """Mirror of the kernel's ``DecodeArgs``, field for field."""

    _fields_ = [
        ("query", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("stride_cb", ctypes.c_int64),
        ("stride_ch", ctypes.c_int64),
        ("stride_cn", ctypes.c_int64),
        ("stride_cc", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("block_table", ctypes.c_void_p),
        ("stride_bt", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("token_of", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
        ("num_q_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_size", ctypes.c_int),
        ("head_size_v", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("kernel_block_size", ctypes.c_int),
        ("sliding_window", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
    ]


@functools.cache
def decode_kernel():
    """The compiled kernel's entry point, or None when it cannot be built here."""
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU decode kernel unavailable (%s); using the torch path", exc)
        return None
    function = library.paged_decode_attention
    function.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int64, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _build() -> Path:
    return build_library(SOURCE, ("-fopenmp",))


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    token_of: torch.Tensor,
    block_size: int,
    params: AttentionParams,
    out: torch.Tensor,
) -> None:
    """Attention of one query row per request over its paged K/V, written into ``out``.

    ``query`` ``[T, Hq, D]`` and ``out`` ``[T, Hq, Dv]`` are contiguous fp32; request ``i``
    (row ``i`` of the int32 ``block_table``, ``seq_lens`` tokens) owns row ``token_of[i]``.
    ``kv_cache`` is a ``[B, H, N, C]`` view of any layout, fp32, bf16 or fp16.
    """
    kernel = decode_kernel()
    if kernel is None:
        raise RuntimeError("the CPU decode kernel is not available on this machine")
    num_q_heads, head_size = query.shape[1:]
    head_size_v = params.resolve_head_size_v(head_size)
    check_kv_cache(kv_cache, params.num_kv_heads, head_size, head_size_v)
    group = check_query_heads(num_q_heads, params.num_kv_heads)
    if head_size > MAX_HEAD or head_size_v > MAX_HEAD or group > MAX_GROUP:
        raise ValueError(f"head sizes up to {MAX_HEAD} and {MAX_GROUP} query heads per KV head")
    for name, tensor in (("query", query), ("out", out)):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32")
    for name, tensor in (
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("token_of", token_of),
    ):
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32")
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0:
        return
    sinks = None
    if params.sinks is not None:
        sinks = params.sinks.to(device="cpu", dtype=torch.float32).contiguous()
    strides = kv_cache.stride()
    args = DecodeArgs(
        query=query.data_ptr(),
        out=out.data_ptr(),
        cache=kv_cache.data_ptr(),
        stride_cb=strides[0],
        stride_ch=strides[1],
        stride_cn=strides[2],
        stride_cc=strides[3],
        dtype=DTYPE_CODES[kv_cache.dtype],
        block_table=block_table.data_ptr(),
        stride_bt=block_table.stride(0),
        seq_lens=seq_lens.data_ptr(),
        token_of=token_of.data_ptr(),
        sinks=None if sinks is None else sinks.data_ptr(),
        num_q_heads=num_q_heads,
        num_kv_heads=params.num_kv_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        block_size=block_size,
        kernel_block_size=kv_cache.shape[2],
        sliding_window=params.sliding_window or 0,
        scale=params.scale,
        softcap=params.softcap or 0.0,
    )
    _check_host_memory(
        query=query, out=out, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
        token_of=token_of,
    )  # fmt: skip
    if sinks is not None:
        _check_host_memory(sinks=sinks)
    if kernel(ctypes.byref(args), num_reqs * params.num_kv_heads, attention_threads()) != 0:
        raise ValueError("the CPU decode kernel refused these sizes")


def attention_threads() -> int:
    """The threads the kernel spreads its items (request, KV head) over: every thread torch
    has, since the kernel splits long items' keys and one request keeps them all busy."""
    return max(1, min(torch.get_num_threads(), MAX_THREADS))


def _check_host_memory(**tensors: torch.Tensor) -> None:
    """The kernel dereferences raw pointers: anything but host memory would crash it."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; the CPU kernel reads host memory")
