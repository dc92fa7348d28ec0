"""``x @ W^T`` for a ``QuantizedMatrix`` W on GPUs: one Triton kernel that expands each tile of
GGUF blocks in registers, right before the product, so a decode step reads the integers from
memory once (Q4 is 5 bits a weight, 0.31x bf16's bytes).

One program per (``BLOCK_M`` rows of x, ``BLOCK_N`` output features); the K loop takes two
32-weight blocks a step. A 4-bit tile is gathered from the packed bytes: column c of a block
is the low nibble of byte ``c % 16`` for c < 16, the high nibble for the rest (GGUF's order,
``QuantizedMatrix.dequantize``), then ``scale * q + min`` in float32; an 8-bit one is
``scale * q``. Products run in x's dtype with float32 accumulation (float32 inputs take the
exact ieee path). ``M`` is not specialised, so one compile per (kind, dtype, row tile) serves
every step; row tiles are 16, 32 or 64 rows. The torch reference is
``QuantizedMatrix.dequantize`` followed by ``F.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant.gguf_blocks import BLOCK, Q4, QuantizedMatrix
from kernels.triton_support import TL_DTYPES, dot_constexprs

BLOCK_N = 64
BLOCK_K = 2 * BLOCK  # two GGUF blocks per step of the K loop
ROW_TILES = (16, 32, 64)  # tl.dot needs 16 rows on GPUs; past 64 rows tiles repeat


@triton.jit(do_not_specialize=["num_rows"])
def _gguf_matmul_kernel(
    x_ptr, qs_ptr, scales_ptr, mins_ptr, y_ptr,
    num_rows, num_cols, size_k,
    stride_xm, stride_qn, stride_sn, stride_mn, stride_ym,
    IS_Q4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < num_rows
    is_col = cols < num_cols
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = cols[None, :].to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, size_k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        is_k = ks < size_k
        x = tl.load(x_rows + ks[None, :], mask=is_row[:, None] & is_k[None, :], other=0.0)
        w_mask = is_k[:, None] & is_col[None, :]
        block = ks // 32  # [BLOCK_K]: the GGUF block of each column
        scale = tl.load(scales_ptr + w_cols * stride_sn + block[:, None], mask=w_mask, other=0.0)
        if IS_Q4:
            within = ks % 32
            byte = block * 16 + within % 16
            packed = tl.load(qs_ptr + w_cols * stride_qn + byte[:, None], mask=w_mask, other=0)
            shift = (within // 16) * 4
            q = ((packed.to(tl.int32) >> shift[:, None]) & 15).to(tl.float32)
            low = tl.load(mins_ptr + w_cols * stride_mn + block[:, None], mask=w_mask, other=0.0)
            w = q * scale.to(tl.float32) + low.to(tl.float32)
        else:
            q = tl.load(qs_ptr + w_cols * stride_qn + ks[:, None], mask=w_mask, other=0)
            w = q.to(tl.float32) * scale.to(tl.float32)
        acc += tl.dot(
            x.to(COMPUTE_DTYPE), w.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION
        )  # [BLOCK_M, BLOCK_N]
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


def row_tile(num_rows: int) -> int:
    """The smallest row tile that holds ``num_rows`` (the largest past it)."""
    return next((tile for tile in ROW_TILES if num_rows <= tile), ROW_TILES[-1])


def quantized_linear(
    x: torch.Tensor, weight: QuantizedMatrix, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T + b`` for x of any leading shape in float32, bfloat16 or float16 on the
    weight's device; the result in x's dtype."""
    n, k = weight.shape
    if x.dtype not in TL_DTYPES:
        raise ValueError(
            f"quantized weights take float32, bfloat16 or float16 inputs, not {x.dtype}"
        )
    if x.device != weight.qs.device:
        raise ValueError(f"inputs on {x.device}, quantized weight on {weight.qs.device}")
    for name, part in (("qs", weight.qs), ("scales", weight.scales), ("mins", weight.mins)):
        if part.numel() and part.stride(-1) != 1:
            raise ValueError(f"the quantized weight's {name} rows must be contiguous")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows:
        is_q4 = weight.kind == Q4
        mins = weight.mins if is_q4 else weight.scales  # never read for Q8
        tile = row_tile(num_rows)
        grid = (triton.cdiv(num_rows, tile), triton.cdiv(n, BLOCK_N))
        _gguf_matmul_kernel[grid](
            rows, weight.qs, weight.scales, mins, out,
            num_rows, n, k,
            rows.stride(0), weight.qs.stride(0), weight.scales.stride(0), mins.stride(0),
            out.stride(0),
            IS_Q4=is_q4, BLOCK_M=tile, **_constexprs(x.dtype),
        )  # fmt: skip
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)


def _constexprs(dtype: torch.dtype) -> dict:
    return dict(BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **dot_constexprs(dtype))
