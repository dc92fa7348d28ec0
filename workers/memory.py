"""How much GPU memory the KV cache may take, measured the way vLLM sizes its cache.

Two snapshots bracket the worker's startup: one before the weights load, one after a
profiling step of the largest size the engine will run, through the serving attention backend
and the sampler. The cache gets the configured share of the GPU (``gpu_memory_utilization``)
minus everything this process added in between: the weights, the step's peak activations,
the sampler's ``[max_num_seqs, vocab]`` logits, and memory outside PyTorch's allocator (NCCL
buffers, cuBLAS workspaces, Triton's modules). What the device held before (other processes,
this process's CUDA context) is not ours to count, but it must leave room for our share.
Memory this process's allocator holds cached but unused (an engine this process ran before:
an in-process benchmark, a rebuilt local server) is released first and, where some stays
reserved, counted as ours to use.

The arithmetic is a pure function of the snapshots, so it is tested with made-up figures on
machines without a GPU.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

GiB = 1 << 30


class InsufficientGpuMemoryError(ValueError):
    """The GPU cannot hold this worker's share, or the share leaves nothing for the cache."""


@dataclass(frozen=True)
class MemorySnapshot:
    total_bytes: int  # the device's memory
    free_bytes: int  # what the whole device has left (torch.cuda.mem_get_info)
    torch_allocated_bytes: int  # held by live tensors of this process
    torch_reserved_bytes: int  # held by this process's caching allocator
    torch_peak_bytes: int  # the allocator's high-water mark since the last reset

    @property
    def cached_unused_bytes(self) -> int:
        """Held by this process's allocator but by no live tensor: ours to reuse."""
        return max(0, self.torch_reserved_bytes - self.torch_allocated_bytes)

    @property
    def non_torch_bytes(self) -> int:
        """Device memory in use that this process's allocator does not account for."""
        return self.total_bytes - self.free_bytes - self.torch_reserved_bytes


class CudaMemoryProbe:
    """Snapshots of one CUDA device. ``cuda`` is ``torch.cuda`` or, in tests on machines
    without a GPU, an object with the same memory functions."""

    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.device = device
        self._cuda = cuda

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        # An earlier engine's tensors sit in reference cycles until collected; only then can
        # the allocator hand their blocks back to the device.
        gc.collect()
        self._cuda.empty_cache()

    def snapshot(self) -> MemorySnapshot:
        self._cuda.synchronize(self.device)
        free, total = self._cuda.mem_get_info(self.device)
        return MemorySnapshot(
            total_bytes=total,
            free_bytes=free,
            torch_allocated_bytes=self._cuda.memory_allocated(self.device),
            torch_reserved_bytes=self._cuda.memory_reserved(self.device),
            torch_peak_bytes=self._cuda.max_memory_allocated(self.device),
        )


@dataclass(frozen=True)
class KVCacheBudget:
    requested_bytes: int  # total * gpu_memory_utilization
    weights_bytes: int
    activation_peak_bytes: int  # the profiling step's peak above the weights
    non_torch_increase_bytes: int
    kv_cache_bytes: int

    def describe(self) -> str:
        return (
            f"GPU memory share {self.requested_bytes / GiB:.2f} GiB = weights "
            f"{self.weights_bytes / GiB:.2f} GiB + peak activations "
            f"{self.activation_peak_bytes / GiB:.2f} GiB + outside PyTorch "
            f"{self.non_torch_increase_bytes / GiB:.2f} GiB + KV cache "
            f"{self.kv_cache_bytes / GiB:.2f} GiB"
        )


def check_room_for_share(before: MemorySnapshot, utilization: float) -> int:
    """The bytes this worker may use; refuses when others already hold part of them."""
    requested = int(before.total_bytes * utilization)
    available = before.free_bytes + before.cached_unused_bytes
    if available < requested:
        raise InsufficientGpuMemoryError(
            f"The GPU has {available / GiB:.2f} GiB free of {before.total_bytes / GiB:.2f}"
            f" GiB, less than this worker's share of {requested / GiB:.2f} GiB "
            f"(--gpu-memory-utilization {utilization}); "
            f"{(before.total_bytes - available) / GiB:.2f} GiB is held by other "
            "processes, this process's CUDA context or its live tensors. Lower "
            "--gpu-memory-utilization or free the GPU."
        )
    return requested


def kv_cache_budget(
    before: MemorySnapshot,
    after: MemorySnapshot,
    utilization: float,
    scratch_cache_bytes: int = 0,
) -> KVCacheBudget:
    """The KV cache's bytes from a snapshot before the weights load (with the peak counter
    reset then) and one after the profiling step (with the allocator's cache released).
    ``scratch_cache_bytes`` is the profiling step's own small KV cache: part of the peak, but
    not something serving will hold beside the real cache."""
    requested = check_room_for_share(before, utilization)
    weights = max(0, after.torch_allocated_bytes - before.torch_allocated_bytes)
    peak = max(0, after.torch_peak_bytes - before.torch_allocated_bytes - scratch_cache_bytes)
    non_torch = max(0, after.non_torch_bytes - before.non_torch_bytes)
    activations = max(0, peak - weights)
    # Another process that grew meanwhile looks like growth of ours: counted, to be safe.
    kv_cache = requested - weights - activations - non_torch
    budget = KVCacheBudget(requested, weights, activations, non_torch, kv_cache)
    if kv_cache <= 0:
        raise InsufficientGpuMemoryError(
            f"No GPU memory is left for the KV cache: {budget.describe()}. Raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, or "
            "use more tensor-parallel ranks."
        )
    return budget
