"""Triton must see TRITON_INTERPRET before its first import, so this runs before any test
module imports kernels. With a GPU the kernels run compiled instead."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def poison_new_outputs(monkeypatch):
    """Every float tensor a backend allocates with ``torch.empty_like`` (its outputs) starts as
    NaN, so a row a kernel leaves unwritten fails even where the allocator hands back memory
    that holds the last run's (correct) result."""
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        out = empty_like(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", poisoned)
