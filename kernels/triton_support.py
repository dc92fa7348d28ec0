"""What every Triton kernel module shares: whether triton runs its interpreter (kernels on the
CPU, ``TRITON_INTERPRET=1`` set before triton was first imported), the Triton type of each
dtype a kernel computes in, and the ``tl.dot`` settings of a launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _probe():
    pass


def is_interpreted() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (kernels run on the CPU)."""
    return isinstance(_probe, InterpretedFunction)


def dot_constexprs(dtype: torch.dtype) -> dict:
    """``COMPUTE_DTYPE`` and ``DOT_PRECISION`` of a kernel whose ``tl.dot`` reads ``dtype``
    data: products in that dtype on GPUs (float32 ones take the exact ieee path, not tf32);
    float32 under the interpreter, which has no bf16 dot."""
    compute = tl.float32 if is_interpreted() else TL_DTYPES[dtype]
    precision = "ieee" if compute == tl.float32 else "tf32"  # unused for 16-bit products
    return dict(COMPUTE_DTYPE=compute, DOT_PRECISION=precision)
