"""The forward is timed without waiting for the device. On a GPU that means CUDA events read
once the step is over; no GPU here, so ``torch.cuda``'s events and synchronize are replaced by
recorders (what a GPU would run is the same calls in the same order)."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch

from workers import device_timing
from workers.device_timing import DeviceTimer


class RecordedEvent:
    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = len(self.log)
        self.log.append("record")

    def synchronize(self):
        self.log.append("wait")

    def elapsed_time(self, end: RecordedEvent) -> float:
        return 1000.0 * (end.at - self.at)  # ms: one second per log entry between them


@pytest.fixture
def fake_cuda_events(monkeypatch):
    RecordedEvent.log = []

    def refuse(*args):
        raise AssertionError("the timer waited for the whole device")

    monkeypatch.setattr(device_timing.torch.cuda, "Event", RecordedEvent)
    monkeypatch.setattr(device_timing.torch.cuda, "synchronize", refuse)
    return RecordedEvent.log


def test_on_a_gpu_the_intervals_are_events_read_only_when_asked(fake_cuda_events):
    timer = DeviceTimer(torch.device("cuda", 0))
    timer.start()
    timer.stop()
    fake_cuda_events.append("other work")
    timer.start()
    fake_cuda_events.append("a kernel")
    timer.stop()
    assert "wait" not in fake_cuda_events  # nothing waited while the step was queued
    assert timer.seconds() == 1.0 + 2.0
    assert fake_cuda_events.count("wait") == 1


def test_on_a_cpu_the_intervals_are_the_wall_clock():
    timer = DeviceTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.stop()
    time.sleep(0.05)  # between intervals: not counted
    timer.start()
    timer.stop()
    assert 0.02 <= timer.seconds() < 0.05
