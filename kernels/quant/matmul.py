"""``x @ W^T`` for a ``QuantizedMatrix`` W by the kernel of x's device: the C kernel on CPUs
(``kernels.quant.cpu_matmul``), the Triton one on GPUs (``kernels.quant.triton_matmul``,
imported only there: a CPU worker never loads triton)."""

from __future__ import annotations

import torch

from kernels.quant import cpu_matmul
from kernels.quant.gguf_blocks import QuantizedMatrix
from kernels.registry import check_can_launch


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedMatrix,
    bias: torch.Tensor | None = None,
    sampled_rows: bool = False,
) -> torch.Tensor:
    """``sampled_rows``: x holds an LM head's rows (the CPU kernel may then take its integer
    path for more of them; the Triton kernel has one path)."""
    if x.device.type == "cpu":
        return cpu_matmul.quantized_linear(x, weight, bias, sampled_rows)
    check_can_launch(x.device, "GGUF matmul")
    from kernels.quant import triton_matmul

    return triton_matmul.quantized_linear(x, weight, bias)
