"""Linear layers on CPUs with their weights packed once for oneDNN.

``F.linear`` on a CPU hands MKL the weight in its checkpoint layout at every call, which costs
about as much as the product for the few rows of a decode step. oneDNN's blocked copy of the
weight, made once after loading, measured 1.5-2.5x faster here at every row count from 1 to
2048 (fp32, two cores). Only fp32 weights on CPUs are packed; everything else keeps
``F.linear``. A packed layer drops its unpacked weight (a second copy of the model would
double its memory), so the layer must not be loaded again afterwards. A weight kept in GGUF's
quantized blocks (``workers.quantization``), on any device, is swapped for its blocks the same
way and multiplied by ``kernels.quant.matmul`` (the C kernel on CPUs, Triton on GPUs).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quant.gguf_blocks import QuantizedMatrix
from kernels.quant.matmul import quantized_linear

logger = logging.getLogger(__name__)


def pack_weight(weight: torch.Tensor):
    """oneDNN's packed copy of an ``[out, in]`` weight, the ``QuantizedMatrix`` a weight kept
    quantized holds, or None where neither serves it."""
    quantized = getattr(weight, "quantized", None)
    if quantized is not None:
        return quantized
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError) as exc:  # an op this build lacks
        logger.warning("Packing CPU linear weights failed (%s); using F.linear", exc)
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed, bias=None, sampled_rows: bool = False
) -> torch.Tensor:
    """``sampled_rows``: x holds an LM head's rows (``kernels.quant.matmul``)."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, QuantizedMatrix):
        return quantized_linear(x, packed, bias, sampled_rows)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every layer that offers ``pack_for_cpu``; returns how many were packed."""
    layers = [m for m in model.modules() if hasattr(m, "pack_for_cpu")]
    return sum(1 for layer in layers if layer.pack_for_cpu())
