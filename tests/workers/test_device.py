"""Device selection on GPU workers, checked without a GPU: CUDA availability is faked, and
``torch.cuda.set_device`` runs for real up to the driver call (which is what refuses a device
without an index). A worker whose placement reserved a GPU that torch cannot use fails with
the versions that disagree instead of drifting onto the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from workers import device as device_module
from workers.device import GpuUnavailableError, distributed_backend, select_device
from workers.worker import Worker, WorkerOptions

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch believes one GPU is visible; the driver call of set_device is recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    return calls


@pytest.mark.parametrize("requested", [None, "cuda", "cuda:0"])
def test_a_gpu_worker_gets_an_indexed_device_that_set_device_accepts(fake_cuda, requested):
    device = select_device(requested)
    assert device == torch.device("cuda", 0)
    torch.cuda.set_device(device)  # the real function: refuses a device without an index
    assert fake_cuda == [0]
    assert distributed_backend(device) == "nccl"


def test_the_worker_sets_its_indexed_device_before_joining_its_group(fake_cuda, monkeypatch):
    joined = []
    monkeypatch.setattr(
        "workers.worker.init_tp_group",
        lambda rank, world_size, init_method, *, backend, **_: joined.append(backend),
    )
    worker = Worker(0, WorkerOptions(device="cuda"))
    assert worker.device == torch.device("cuda", 0)
    worker.init_tp_group(None)
    assert fake_cuda == [0] and joined == ["nccl"]


def test_without_a_gpu_the_cpu_is_chosen_and_joins_over_gloo():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert select_device(None) == torch.device("cpu")
    assert select_device("cpu") == torch.device("cpu")
    assert distributed_backend(torch.device("cpu")) == "gloo"


def test_a_reserved_gpu_that_torch_cannot_use_fails_loudly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(device_module, "nvidia_driver_version", lambda: "535.104.05")

    def driver_too_old():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12020).")

    monkeypatch.setattr(torch.cuda, "init", driver_too_old)
    with pytest.raises(GpuUnavailableError) as info:
        Worker(0, WorkerOptions(device="cuda"))
    message = str(info.value)
    assert "CUDA_VISIBLE_DEVICES='3'" in message
    assert f"torch {torch.__version__}" in message
    assert "driver on your system is too old" in message
    assert "NVIDIA driver: 535.104.05" in message


def test_the_driver_version_is_read_from_the_kernel_module_line(tmp_path, monkeypatch):
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC"
    fake = tmp_path / "version"
    fake.write_text(line + "\nGCC version: gcc 12\n")
    real_path = device_module.Path
    monkeypatch.setattr(
        device_module,
        "Path",
        lambda p: fake if p == "/proc/driver/nvidia/version" else real_path(p),
    )
    assert device_module.nvidia_driver_version() == "580.65.06"


def test_no_cuda_device_without_an_index_remains_in_the_tree():
    # torch.device("cuda") and torch.device("cuda" if ... else ...) both leave the index out.
    unindexed = re.compile(r"""torch\.device\(\s*["']cuda["']\s*(\)|if\b)""")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("kvcore", "kernels", "workers", "cluster", "tests")
        for path in (ROOT / folder).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if unindexed.search(line) and path != Path(__file__)
    ]
    assert offenders == []
