"""Engine statistics users judge an engine by, kept cheaply while it runs.

Step overhead is the time between rank 0's answers to two steps minus its model forward:
scheduling, the coordinator, plan transport, sampling, detokenizing, whatever keeps the
workers from the next forward (``AsyncEngine._step_wall`` says whose clock measures it). KV
memory waste is the share of allocated token slots that hold no token, sampled every few steps
and averaged over the run.
"""

from __future__ import annotations

import statistics
from collections import deque

WASTE_SAMPLE_EVERY = 8  # steps between waste samples (a sample walks every block table)


def percentile(values, fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


class EngineStats:
    def __init__(self, window: int = 4096):
        self.step_overheads: deque[float] = deque(maxlen=window)  # seconds
        self.num_steps = 0
        self._waste_sum = 0.0
        self._waste_samples = 0

    def record_step(self, wall_seconds: float, forward_seconds: float) -> None:
        self.num_steps += 1
        self.step_overheads.append(max(0.0, wall_seconds - forward_seconds))

    def wants_waste_sample(self) -> bool:
        return self.num_steps % WASTE_SAMPLE_EVERY == 0

    def record_waste(self, allocated_slots: int, used_slots: int) -> None:
        if allocated_slots > 0:
            self._waste_sum += 1.0 - used_slots / allocated_slots
            self._waste_samples += 1

    @property
    def kv_memory_waste(self) -> float:
        return self._waste_sum / self._waste_samples if self._waste_samples else 0.0

    def summary(self) -> dict:
        overheads_ms = [s * 1000 for s in self.step_overheads]
        return {
            "num_steps": self.num_steps,
            "step_overhead_median_ms": statistics.median(overheads_ms) if overheads_ms else 0.0,
            "step_overhead_p99_ms": percentile(overheads_ms, 0.99),
            "kv_memory_waste": self.kv_memory_waste,
        }
