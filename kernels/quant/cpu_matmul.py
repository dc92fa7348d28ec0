"""``x @ W^T`` for a ``QuantizedMatrix`` W on CPUs, by the C kernel
``kernels/quant/cpu/gguf_matmul.c`` (built at first use like the decode-attention kernel).

Up to ``KERNEL_MAX_ROWS`` rows of x (decode steps, short chunks) the kernel expands each block
in registers and streams the integers from memory once. Where expanding the weights is most
of the work, AVX2 machines take the kernel's integer path instead: x is held as int16 per
32-value block (14 significant bits, an error of at most half a step of ``max|x| / 16383``
per value) and multiplied with integer multiply-adds, several x rows per widened block. How
many rows that pays for the kernel says (``int16_max_rows``): one or two with AVX-512's
float tiles, up to 8 against AVX2's. With AVX-512 VNNI the integer path splits x into bytes
and multiplies them with W's bytes directly, for up to ``split_max_rows`` rows: an LM head's
(``logits_int16_max_rows``), a decode step's layers only one or two. Longer inputs
(prefill chunks) are compute-bound: there a weight of moderate size is expanded to float32
once and handed to the float GEMM; a large one (an LM head) stays with the kernel.
Where no compiler is found, ``kernel()`` is None and the caller keeps float weights instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.c_build import build_library
from kernels.quant.gguf_blocks import Q4, Q8, QuantizedMatrix

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "gguf_matmul.c"
KIND_CODES = {Q4: 0, Q8: 1}
KERNEL_MAX_ROWS = 32  # measured with random weights at SmolLM2's shapes (two cores)
# Rows up to which the integer path serves; None: the bound the kernel measured for its CPU.
INT16_MAX_ROWS: int | None = None
# A weight past this many values is never expanded: expanding a 49152 x 576 LM head for every
# step of 33+ requests would write 113 MB per step, more than the kernel's extra arithmetic.
EXPAND_MAX_VALUES = 8 << 20


class QMatmulArgs(ctypes.Structure):
    """Mirror of the kernel's ``QMatmulArgs``, field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("stride_x", ctypes.c_int64),
        ("y", ctypes.c_void_p),
        ("stride_y", ctypes.c_int64),
        ("qs", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("kind", ctypes.c_int),
    ]


@functools.cache
def kernel():
    """The compiled library, or None when it cannot be built here."""
    try:
        # -fopenmp: the kernel's threads are the OpenMP pool torch has already started.
        library = ctypes.CDLL(str(build_library(SOURCE, ("-fopenmp",))))
    except (OSError, ValueError) as exc:
        logger.warning("CPU quantized matmul kernel unavailable (%s)", exc)
        return None
    entry_points = ("gguf_matmul", "gguf_matmul_int16", "gguf_dequantize")
    for name in (*entry_points, "gguf_int16_max_rows", "gguf_split_max_rows"):
        function = getattr(library, name)
        function.restype = ctypes.c_int
    library.gguf_matmul.argtypes = [ctypes.POINTER(QMatmulArgs)]
    library.gguf_matmul_int16.argtypes = [ctypes.POINTER(QMatmulArgs)]
    library.gguf_int16_max_rows.argtypes = library.gguf_split_max_rows.argtypes = []
    library.gguf_dequantize.argtypes = [ctypes.POINTER(QMatmulArgs), ctypes.c_void_p]
    return library


def _args(weight: QuantizedMatrix, x: torch.Tensor | None, y: torch.Tensor | None) -> QMatmulArgs:
    args = QMatmulArgs.from_buffer_copy(_weight_args(weight))
    if x is not None:
        args.x, args.stride_x, args.m = x.data_ptr(), x.stride(0), x.shape[0]
    if y is not None:
        args.y, args.stride_y = y.data_ptr(), y.stride(0)
    return args


def _weight_args(weight: QuantizedMatrix) -> QMatmulArgs:
    """The weight's half of the kernel's arguments, made once per weight (a decode step calls
    the kernel some 200 times: rebuilding them was a tenth of SmolLM2's step). Kept while the
    weight's blocks stay where they are (loading copies into them in place)."""
    pointers = (weight.qs.data_ptr(), weight.scales.data_ptr(), weight.mins.data_ptr())
    cached = weight._kernel_args
    if cached is not None and cached[0] == pointers:
        return cached[1]
    for name, part in (("qs", weight.qs), ("scales", weight.scales), ("mins", weight.mins)):
        if not part.is_contiguous():
            raise ValueError(f"the quantized weight's {name} must be contiguous")
    n, k = weight.shape
    args = QMatmulArgs(
        qs=pointers[0],
        scales=pointers[1],
        mins=pointers[2] if weight.kind == Q4 else None,
        n=n,
        k=k,
        kind=KIND_CODES[weight.kind],
    )
    weight._kernel_args = (pointers, args)
    return args


def _call(function, *args) -> None:
    code = function(*args)
    if code:
        raise RuntimeError(f"{function.__name__} failed with code {code}")


def matmul_function(num_rows: int, sampled_rows: bool = False):
    """The kernel's entry point for products of ``num_rows`` rows (``sampled_rows``: an LM
    head's)."""
    library = kernel()
    if num_rows <= (logits_int16_max_rows() if sampled_rows else int16_max_rows()):
        return library.gguf_matmul_int16
    return library.gguf_matmul


def has_int16_path() -> bool:
    return _kernel_int16_max_rows() > 0


def split_max_rows() -> int:
    """Rows up to which the integer path multiplies bytes with vpdpbusd (0: no AVX-512 VNNI
    here, vpmaddwd serves them)."""
    return int(kernel().gguf_split_max_rows()) if has_int16_path() else 0


def int16_max_rows() -> int:
    """Rows up to which products take the integer path (0: none, no AVX2 here)."""
    if not has_int16_path():
        return 0
    return _kernel_int16_max_rows() if INT16_MAX_ROWS is None else INT16_MAX_ROWS


def logits_int16_max_rows() -> int:
    """Rows up to which an LM head's product takes the integer path: as far as the split form
    goes where the CPU has it. An LM head's rows are sampled positions, never a prompt chunk
    whose keys and values later tokens read (a chunk on the integer path moved the real model's
    greedy answers: layers keep the float tiles from 3 rows), and on the split form each row's
    logits are bit for bit those it gets alone: a speculative verification's rows get what
    decoding them one at a time would, faster (the kernel's ``SPLIT_MAX_ROWS`` says by how
    much)."""
    if INT16_MAX_ROWS is not None:
        return INT16_MAX_ROWS
    return max(int16_max_rows(), split_max_rows())


@functools.cache
def _kernel_int16_max_rows() -> int:
    return int(kernel().gguf_int16_max_rows())


def dequantize(weight: QuantizedMatrix) -> torch.Tensor:
    """The float32 ``[rows, cols]`` weight, expanded by the kernel on all threads."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    _call(kernel().gguf_dequantize, _args(weight, None, None), out.data_ptr())
    return out


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedMatrix,
    bias: torch.Tensor | None = None,
    sampled_rows: bool = False,
) -> torch.Tensor:
    """``x @ W^T + b`` for float32 ``x`` of any leading shape (``sampled_rows``: x holds an LM
    head's rows, see ``logits_int16_max_rows``)."""
    n, k = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quantized weights take float32 CPU inputs, not {x.dtype} {x.device}")
    rows = x.reshape(-1, k)
    if rows.shape[0] > KERNEL_MAX_ROWS and n * k <= EXPAND_MAX_VALUES:
        return F.linear(x, dequantize(weight), bias)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        _call(matmul_function(rows.shape[0], sampled_rows), _args(weight, rows, out))
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
