"""What every Triton kernel module shares: whether triton runs its interpreter (kernels on the
CPU, ``TRITON_INTERPRET=1`` set before triton was first imported), and the Triton type of
each cache dtype a kernel computes in."""

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
