"""Triton must see TRITON_INTERPRET before its first import, so this runs before any test
module imports kernels. With a GPU the kernels run compiled instead."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
