"""``--quantization``: which weights of a GGUF stay in their integer blocks.

``gguf`` (the default for a GGUF) keeps every weight of a linear layer or embedding whose GGUF
tensors are all of a type with a kernel (Q4_0, Q4_1, Q8_0) as a ``QuantizedMatrix``, on the
worker's device, multiplied by ``kernels.quant.matmul`` (C on CPUs with float32 activations,
Triton on GPUs with float32, bfloat16 or float16 ones); a layer fed by any other type (K-quants,
floats) is dequantized to --dtype as before. ``none`` dequantizes everything. At
one row a step reads every weight once, so the bytes read are the step's time: Q4_1 is 5 bits
a weight against float32's 32.

The activations stay float32 either way (the kernel expands each block to float32 in
registers), so logits match the dequantized model's up to summation order.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from kernels.quant.cpu_matmul import kernel
from kernels.quant.gguf_blocks import GGUF_TYPES, QuantizedMatrix
from workers.gguf import GGUFMetadata, hf_tensor_name
from workers.loader import is_skipped, parameter_target
from workers.model_config import UnsupportedModelError

logger = logging.getLogger(__name__)
QUANTIZATIONS = ("gguf", "none")


def keeps_quantized(
    option: str | None, *, is_gguf: bool, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether this worker keeps a GGUF's blocks; ``option`` None is the default (yes on CPU
    workers serving float32, where the kernel runs). An explicit ``gguf`` that cannot be
    served is refused by name."""
    if option not in (None, *QUANTIZATIONS):
        raise UnsupportedModelError(
            f"Unknown --quantization {option!r}. Supported: {', '.join(QUANTIZATIONS)}"
        )
    if option == "none" or not is_gguf:
        if option == "gguf":
            raise UnsupportedModelError("--quantization gguf needs a GGUF model")
        return False
    reason = None
    if device.type == "cuda":
        pass  # the Triton kernel takes float32, bfloat16 and float16 activations
    elif device.type != "cpu":
        reason = f"on {device.type} workers GGUF weights are dequantized (no kernel)"
    elif dtype != torch.float32:
        reason = f"the CPU kernel takes float32 activations, not --dtype {dtype}"
    elif kernel() is None:
        reason = "the CPU kernel could not be compiled (no C compiler)"
    if reason is None:
        return True
    if option == "gguf":
        raise UnsupportedModelError(f"--quantization gguf: {reason}; use --quantization none")
    logger.info("Serving the GGUF dequantized: %s", reason)
    return False


def plan_quantized(model: nn.Module, meta: GGUFMetadata) -> dict[str, str]:
    """GGUF tensor name -> the kind it is held as, for every tensor whose parameter can hold
    blocks and is fed only by tensors with a kernel (a fused QKV whose V is Q6_K stays float)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    feeds: dict[str, list[str]] = defaultdict(list)  # parameter -> its GGUF tensors
    for name in meta.tensors:
        hf_name = hf_tensor_name(name)
        if hf_name is None or is_skipped(model, hf_name):
            continue
        param_name, _ = parameter_target(model, hf_name)
        module_name, _, leaf = param_name.rpartition(".")
        if leaf == "weight" and param_name in params and _holds_blocks(model, module_name):
            feeds[param_name].append(name)
    plan = {}
    for tensors in feeds.values():
        kinds = {GGUF_TYPES.get(meta.types[t], (None,))[0] for t in tensors}
        if len(kinds) == 1 and None not in kinds:
            plan.update(dict.fromkeys(tensors, kinds.pop()))
    return plan


def _holds_blocks(model: nn.Module, module_name: str) -> bool:
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    return getattr(module, "holds_quantized", False)


def keep_quantized(model: nn.Module, plan: dict[str, str], device="cpu") -> int:
    """Give each planned parameter an empty ``QuantizedMatrix`` of its shape on ``device`` for
    its loader to fill, and let its float storage go; returns the bytes the blocks take."""
    params = dict(model.named_parameters(remove_duplicate=False))
    total = 0
    for name, kind in plan.items():
        param = params[parameter_target(model, hf_tensor_name(name))[0]]
        if getattr(param, "quantized", None) is None:
            param.quantized = QuantizedMatrix.zeros(kind, *param.shape, device=device)
            param.data = torch.empty(0, dtype=param.dtype, device=device)
            total += param.quantized.nbytes
    return total
