"""Timing device work without waiting for it, and bringing a step's tokens back to the host.

On a GPU the forward's kernels are queued, so the wall clock around the call measures the
queueing; waiting for the device to time it (``torch.cuda.synchronize``) would stall the host
while it could prepare the sampler's masks or the next step. CUDA events are recorded on the
stream instead and read once the step's tokens have been copied back, which waits for the
device anyway. On a CPU the work is done when the call returns, and the wall clock is right.
"""

from __future__ import annotations

import time

import torch


class DeviceTimer:
    """Sums the device time of the intervals between ``start()`` and ``stop()``."""

    def __init__(self, device: torch.device):
        self._is_cuda = device.type == "cuda"
        self._events: list[tuple] = []
        self._seconds = 0.0
        self._started: float | torch.cuda.Event | None = None

    def start(self) -> None:
        if self._is_cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self._is_cuda:
            stopped = torch.cuda.Event(enable_timing=True)
            stopped.record()
            self._events.append((self._started, stopped))
        else:
            self._seconds += time.perf_counter() - self._started
        self._started = None

    def seconds(self) -> float:
        """The intervals' total; on a GPU this waits for the last one to finish (the events
        are on one stream: the earlier ones are done by then)."""
        if self._events:
            self._events[-1][1].synchronize()
        for started, stopped in self._events:
            self._seconds += started.elapsed_time(stopped) / 1000
        self._events.clear()
        return self._seconds


def to_host_list(values: torch.Tensor) -> list:
    """``values.tolist()``, copied off a GPU through pinned memory: one direct transfer that
    the host waits for, instead of a copy staged through pageable memory."""
    if values.device.type != "cuda":
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
