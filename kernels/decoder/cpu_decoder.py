"""The C decoder-layer kernels (``kernels/decoder/cpu/decoder_layer.c``) through ctypes: the
structures they read, mirrored field for field, and the library, built at first use like the
other CPU kernels: two blocks per layer for GGUF weights, and the glue between projections
(``residual_norm``, ``attend``, ``gated_silu``) for weights multiplied elsewhere. The GGUF
matmul and the paged decode attention stay in their own libraries; their entry points are
handed over in ``DecoderModel``."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kernels.attention.cpu_attention import DecodeArgs, decode_kernel
from kernels.c_build import build_library
from kernels.quant import cpu_matmul
from kernels.quant.gguf_blocks import Q4, QuantizedMatrix

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "decoder_layer.c"
_ptr = ctypes.c_void_p


class QWeight(ctypes.Structure):
    _fields_ = [
        ("qs", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("kind", ctypes.c_int),
        ("bias", _ptr),
    ]


class DecoderModel(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_size", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("matmul", _ptr),
        ("matmul_int16", _ptr),
        ("int16_max_rows", ctypes.c_int64),
        ("attention", _ptr),
    ]


class DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", QWeight),
        ("o", QWeight),
        ("gate_up", QWeight),
        ("down", QWeight),
        ("cache", _ptr),
        ("stride_cb", ctypes.c_int64),
        ("stride_ch", ctypes.c_int64),
        ("stride_cn", ctypes.c_int64),
        ("kernel_block_size", ctypes.c_int),
        ("cache_dtype", ctypes.c_int),  # cpu_attention.DTYPE_CODES
    ]


class DecoderStep(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int64),
        ("residual", _ptr),
        ("delta", _ptr),
        ("has_delta", ctypes.c_int),
        ("normed", _ptr),
        ("qkv", _ptr),
        ("query", _ptr),
        ("attended", _ptr),
        ("gate_up", _ptr),
        ("activated", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("attention", DecodeArgs),
        ("num_items", ctypes.c_int64),
        ("num_threads", ctypes.c_int),
    ]


@functools.cache
def decoder_library():
    """The compiled library with the GGUF matmul and the decode attention it calls, or None
    where any of the three cannot be built here."""
    if cpu_matmul.kernel() is None or decode_kernel() is None:
        return None
    try:
        # -fopenmp: gated_silu's threads are the OpenMP pool torch has already started.
        library = ctypes.CDLL(str(build_library(SOURCE, ("-fopenmp",))))
    except OSError as exc:
        logger.warning("CPU decoder-layer kernel unavailable (%s)", exc)
        return None
    arguments = [
        ctypes.POINTER(DecoderModel),
        ctypes.POINTER(DecoderLayer),
        ctypes.POINTER(DecoderStep),
    ]
    for name in ("attention_block", "mlp_block", "attend"):
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, ctypes.c_int
    library.residual_norm.argtypes = [
        ctypes.POINTER(DecoderModel),
        _ptr,
        ctypes.POINTER(DecoderStep),
    ]
    library.gated_silu.argtypes = [ctypes.POINTER(DecoderModel), ctypes.POINTER(DecoderStep)]
    library.residual_norm.restype = library.gated_silu.restype = ctypes.c_int
    library.decoder_layers.argtypes = [
        ctypes.POINTER(DecoderModel),
        ctypes.POINTER(DecoderLayer),
        ctypes.c_int64,
        ctypes.POINTER(DecoderStep),
    ]
    library.decoder_layers.restype = ctypes.c_int
    library.gated_silu_rows.argtypes = [_ptr, _ptr, ctypes.c_int64, ctypes.c_int64]
    library.gated_silu_rows.restype = ctypes.c_int
    return library


def gated_silu(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up of float32 rows laid out ``[gate | up]`` on a CPU, in one pass of the C
    kernel; None where it does not serve (another device or dtype, a strided tensor, no
    library here)."""
    if gate_up.device.type != "cpu" or gate_up.dtype != torch.float32:
        return None
    if not gate_up.is_contiguous() or gate_up.shape[-1] % 2 or gate_up.requires_grad:
        return None
    library = decoder_library()
    if library is None:
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    library.gated_silu_rows(gate_up.data_ptr(), out.data_ptr(), out.numel() // inter, inter)
    return out


def entry_point(function) -> int:
    """A ctypes function's address, for the C side to call."""
    return ctypes.cast(function, _ptr).value


def qweight(matrix: QuantizedMatrix, bias=None) -> QWeight:
    n, k = matrix.shape
    return QWeight(
        qs=matrix.qs.data_ptr(),
        scales=matrix.scales.data_ptr(),
        mins=matrix.mins.data_ptr() if matrix.kind == Q4 else None,
        n=n,
        k=k,
        kind=cpu_matmul.KIND_CODES[matrix.kind],
        bias=None if bias is None else bias.data_ptr(),
    )
