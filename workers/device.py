"""Which device a worker computes on, decided once when it starts.

Ray hands a GPU actor exactly the GPUs it reserved through ``CUDA_VISIBLE_DEVICES``, so the
actor's one GPU is always index 0; an in-process worker takes index 0 too. The index is never
left out: ``torch.cuda.set_device`` refuses a device without one.

A worker whose placement reserved a GPU must not drift onto the CPU. That happens when the
installed torch was built for a newer CUDA than the node's driver (``torch.cuda.is_available()``
is then False), and the error must say so then and there, with the versions that disagree.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class GpuUnavailableError(RuntimeError):
    """A GPU was asked for (or reserved) but torch cannot use one."""


def select_device(requested: str | None) -> torch.device:
    """The worker's device: ``requested`` ("cuda", "cuda:1", "cpu"), or when None, GPU 0 if
    torch sees one and the CPU otherwise. A CUDA device always carries an index."""
    if requested is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise GpuUnavailableError(describe_missing_gpu())
    return device if device.index is not None else torch.device("cuda", 0)


def describe_missing_gpu() -> str:
    """Why torch sees no GPU, with the versions a user needs to fix it."""
    try:
        torch.cuda.init()
        reason = "torch.cuda.is_available() is False"
    except Exception as exc:  # the driver's or the build's own words
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    built_for = torch.version.cuda or "no CUDA (a CPU-only build)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"This worker was given a GPU (CUDA_VISIBLE_DEVICES={visible!r}), but torch "
        f"{torch.__version__}, built for CUDA {built_for}, cannot use it: {reason}. NVIDIA "
        f"driver: {nvidia_driver_version() or 'not found'}. Install a torch built for a CUDA "
        "version this driver supports (deploy/gpu-constraints.txt pins the image's), or serve "
        "from CPU-only nodes."
    )


def nvidia_driver_version() -> str | None:
    """The kernel driver's version line, when an NVIDIA driver is loaded on this node."""
    path = Path("/proc/driver/nvidia/version")
    try:
        first = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ..."
    words = first.split()
    versions = [w for w in words if w.count(".") >= 1 and w.replace(".", "").isdigit()]
    return versions[0] if versions else first.strip()


def distributed_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"
