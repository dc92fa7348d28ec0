"""Settings every test process (and every process a test spawns) needs before imports."""

from __future__ import annotations

import os

import torch

# Network traffic stays on loopback: Ray binds 127.0.0.1 and gloo uses lo.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
