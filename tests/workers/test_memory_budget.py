"""GPU KV-cache sizing without a GPU: the arithmetic from made-up ``mem_get_info`` and
allocator figures, and the worker's real path (snapshot, profiling step through the serving
backend and the sampler, snapshot, budget) on the CPU with a scripted memory probe."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.attention import get_attention_backend
from kvcore import RankReport, decode, encode, get_kv_cache_config
from tests.workers.harness import StepDriver
from workers.memory import (
    CudaMemoryProbe,
    InsufficientGpuMemoryError,
    MemorySnapshot,
    kv_cache_budget,
)
from workers.profiling import profile_request_lens
from workers.protocol import StepResult
from workers.worker import Worker, WorkerOptions

GiB = 1 << 30


def snapshot(*, free, allocated=0, reserved=None, peak=None, total=80 * GiB):
    return MemorySnapshot(
        total_bytes=total,
        free_bytes=free,
        torch_allocated_bytes=allocated,
        torch_reserved_bytes=allocated if reserved is None else reserved,
        torch_peak_bytes=allocated if peak is None else peak,
    )


# Before loading: 1 GiB in use (this process's CUDA context). After the profile, with the
# allocator's cache released: 16 GiB of weights, a 3 GiB peak above them plus the 0.25 GiB
# scratch cache, and NCCL's 0.5 GiB outside PyTorch's allocator.
BEFORE = snapshot(free=79 * GiB)
AFTER = snapshot(free=int(62.5 * GiB), allocated=16 * GiB, peak=int(19.25 * GiB))


def test_the_cache_gets_the_share_less_weights_peak_and_non_torch_growth():
    budget = kv_cache_budget(BEFORE, AFTER, 0.9, scratch_cache_bytes=GiB // 4)
    assert budget.requested_bytes == int(80 * GiB * 0.9)
    assert budget.weights_bytes == 16 * GiB
    assert budget.activation_peak_bytes == 3 * GiB
    assert budget.non_torch_increase_bytes == GiB // 2
    assert budget.kv_cache_bytes == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - GiB // 2
    assert "KV cache 52.50 GiB" in budget.describe()


def test_memory_other_processes_hold_must_leave_room_for_the_share():
    crowded = snapshot(free=60 * GiB)  # someone else holds 20 GiB
    with pytest.raises(InsufficientGpuMemoryError) as info:
        kv_cache_budget(crowded, AFTER, 0.9)
    message = str(info.value)
    assert "60.00 GiB free of 80.00 GiB" in message and "share of 72.00 GiB" in message
    assert "--gpu-memory-utilization 0.9" in message


def test_memory_this_process_holds_cached_but_unused_counts_as_free():
    # 10 GiB stays reserved by this process's allocator with no live tensor in it (segments
    # empty_cache could not hand back): the share fits, and the cache gets what it would get
    # on an empty device.
    cached = snapshot(free=69 * GiB, allocated=0, reserved=10 * GiB)
    budget = kv_cache_budget(cached, AFTER, 0.9, scratch_cache_bytes=GiB // 4)
    assert budget == kv_cache_budget(BEFORE, AFTER, 0.9, scratch_cache_bytes=GiB // 4)
    # The same free memory with nothing of ours cached is someone else's.
    with pytest.raises(InsufficientGpuMemoryError, match=r"69\.00 GiB free"):
        kv_cache_budget(snapshot(free=69 * GiB), AFTER, 0.9)


def test_no_room_left_for_the_cache_is_refused_with_the_breakdown():
    huge_weights = snapshot(free=5 * GiB, allocated=70 * GiB, peak=74 * GiB)
    with pytest.raises(InsufficientGpuMemoryError, match=r"weights 70\.00 GiB"):
        kv_cache_budget(BEFORE, huge_weights, 0.9)


def test_memory_taken_by_others_during_startup_counts_against_the_cache():
    others_grew = snapshot(free=int(52.5 * GiB), allocated=16 * GiB, peak=int(19.25 * GiB))
    budget = kv_cache_budget(BEFORE, others_grew, 0.9, scratch_cache_bytes=GiB // 4)
    assert budget.non_torch_increase_bytes == int(10.5 * GiB)
    assert budget.kv_cache_bytes == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - int(10.5 * GiB)


def test_profile_requests_cover_the_longest_prefill_and_the_most_sampled_rows():
    assert profile_request_lens(2048, 256, 4096) == [1793] + [1] * 255
    assert profile_request_lens(8, 256, 4096) == [1] * 8
    assert profile_request_lens(100, 2, 60) == [60, 40]


class ScriptedProbe:
    """Stands in for ``CudaMemoryProbe``: scripted snapshots, recorded calls."""

    def __init__(self, *snapshots):
        self.snapshots = list(snapshots)
        self.calls = []

    def reset_peak(self):
        self.calls.append("reset_peak")

    def release_cached(self):
        self.calls.append("release_cached")

    def snapshot(self):
        self.calls.append("snapshot")
        return self.snapshots.pop(0)


class RecordingBackend:
    """The serving backend, recording the cache and the longest query of each attention call."""

    def __init__(self, backend):
        self._backend = backend
        self.caches = []
        self.query_lens = []

    def forward(self, query, key, value, kv_cache, metadata, params, out=None):
        self.caches.append(kv_cache)
        self.query_lens.append(metadata.max_query_len)
        return self._backend.forward(query, key, value, kv_cache, metadata, params, out)

    def __getattr__(self, name):
        return getattr(self._backend, name)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_the_worker_profiles_through_the_serving_backend_and_sizes_from_the_probe(
    backend_name, monkeypatch
):
    options = WorkerOptions(
        attention_backend=backend_name, max_num_batched_tokens=40, max_num_seqs=6
    )
    worker = Worker(0, options)
    worker.backend = RecordingBackend(get_attention_backend(backend_name))
    worker.memory = ScriptedProbe(BEFORE, AFTER)
    sampled_rows = []
    worker.init_tp_group(None)
    worker.load_model()
    real_logits = worker.model.compute_logits
    monkeypatch.setattr(
        worker.model,
        "compute_logits",
        lambda hidden: sampled_rows.append(hidden.shape[0]) or real_logits(hidden),
    )

    report = decode(worker.report_specs(), RankReport)

    assert worker.memory.calls == [
        "release_cached",
        "reset_peak",
        "snapshot",
        "release_cached",
        "snapshot",
    ]
    expected = kv_cache_budget(BEFORE, AFTER, 0.9, _scratch_bytes(worker)).kv_cache_bytes
    assert report.free_memory_bytes == expected
    num_layers = worker.model_config.num_hidden_layers
    # The profile step, then a decode step (the kernels' decode variants compile then), every
    # layer, paged; max_num_seqs rows of logits went through the sampler each time.
    assert len(worker.backend.caches) == 2 * num_layers
    assert all(cache is not None and cache.dim() == 4 for cache in worker.backend.caches)
    assert worker.backend.query_lens == [35] * num_layers + [1] * num_layers
    assert sampled_rows == [6, 6]
    assert all(layer.kv_cache is None for layer in worker.model.kv_cache_layers().values())

    # The real cache binds afterwards and serves as usual.
    plan = get_kv_cache_config(
        report.specs, 8 << 20, "LBNHC", max_model_len=256, max_num_batched_tokens=256
    )
    worker.allocate_kv_cache(encode(plan))
    driver = StepDriver(
        worker.runner.config, lambda plan: decode(worker.execute(encode(plan)), StepResult)
    )
    driver.next_block = 1
    assert len(driver.generate([("r", list(b"hello"), 4)])["r"]) == 4


def _scratch_bytes(worker) -> int:
    """The scratch cache's size: the first cache each layer saw, all in one buffer."""
    first = worker.backend.caches[0]
    return first.untyped_storage().nbytes()


def test_no_profiling_on_cpu_workers_whose_budget_is_given():
    worker = Worker(0, WorkerOptions(kv_cache_memory_bytes=8 << 20))
    assert worker.memory is None
    worker.init_tp_group(None)
    worker.load_model()
    assert decode(worker.report_specs(), RankReport).free_memory_bytes == 8 << 20
    assert torch.device("cpu") == worker.device


class SimulatedCudaMemory:
    """``torch.cuda``'s memory functions over a simulated device, since no GPU is here: other
    processes and this process's CUDA context hold ``held_elsewhere``; this process's caching
    allocator holds ``allocated`` bytes in live tensors and ``reserved`` in all, and
    ``empty_cache`` hands back every unused block but ``pinned`` bytes (segments a live tensor
    keeps). Only these figures are made up; the workers, their models and profiles are real."""

    def __init__(self, total, held_elsewhere, pinned=0):
        self.total, self.held_elsewhere, self.pinned = total, held_elsewhere, pinned
        self.allocated = self.reserved = self.peak = 0

    def malloc(self, nbytes):
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes):
        self.allocated -= nbytes  # the block stays cached: reserved does not shrink

    def empty_cache(self):
        self.reserved = min(self.reserved, self.allocated + self.pinned)

    def mem_get_info(self, device):
        return self.total - self.held_elsewhere - self.reserved, self.total

    def memory_allocated(self, device):
        return self.allocated

    def memory_reserved(self, device):
        return self.reserved

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated

    def synchronize(self, device):
        pass


class EngineTensorsInACycle:
    """An engine's device tensors that only the garbage collector frees (a model and its
    layers refer to each other), as a finished engine's often are."""

    def __init__(self, cuda, nbytes):
        self.cuda, self.nbytes, self.cycle = cuda, nbytes, self
        cuda.malloc(nbytes)

    def __del__(self):
        self.cuda.free(self.nbytes)


def _start_engine(cuda) -> int:
    """One worker started in this process on the simulated device; its KV cache budget."""
    worker = Worker(0, WorkerOptions(max_num_batched_tokens=40, max_num_seqs=6))
    worker.memory = CudaMemoryProbe(torch.device("cpu"), cuda=cuda)
    worker.init_tp_group(None)
    worker.load_model()
    return decode(worker.report_specs(), RankReport).free_memory_bytes


@pytest.mark.parametrize("pinned", [0, 10 * GiB])
def test_a_second_engine_in_one_process_starts_on_what_the_first_left_cached(pinned):
    cuda = SimulatedCudaMemory(total=80 * GiB, held_elsewhere=GiB, pinned=pinned)
    first_budget = _start_engine(cuda)
    assert first_budget == int(80 * GiB * 0.9)
    gc.disable()  # the first engine's tensors wait for the collector, as they do when it is busy
    try:
        EngineTensorsInACycle(cuda, first_budget)  # its weights and KV cache, then it stops
        assert cuda.allocated == first_budget  # still uncollected
        # The second engine finds its share in what the first left, collected and released
        # (or, where segments stay pinned, still cached but unused).
        assert _start_engine(cuda) == first_budget
    finally:
        gc.enable()
    assert cuda.allocated == 0 and cuda.reserved == pinned
