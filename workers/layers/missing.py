"""The place of a decoder layer another pipeline stage holds."""

from __future__ import annotations

from torch import nn


class OtherStageLayer(nn.Module):
    """Keeps the layer indices of ``model.layers`` those of the checkpoint; holds nothing and
    is never called (a stage runs only its own layers)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"decoder layer {self.index} is held by another pipeline stage")
