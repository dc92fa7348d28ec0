"""Where a step's per-request lists become tensors (the host), before they go to the device in
one copy: every step-metadata builder makes its tensors here."""

from __future__ import annotations

import torch

HOST = torch.device("cpu")
