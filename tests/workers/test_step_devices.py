"""Every tensor the step path makes takes its device from its inputs or says where it lives.

On a GPU, a tensor made without a device lands on the CPU and meets CUDA tensors in the next
op: an error a CPU-only CI never sees, since there everything is on the CPU anyway. Here the
default device is switched to ``meta`` for each step, so a tensor made without a device is a
meta tensor, which fails as soon as it meets real data (or is read back), while every explicit
one still runs. The steps must then give exactly the tokens they give normally.

The sampler's generators are checked the same way: each one must be made for the device of the
logits it draws against (a CPU generator against CUDA probabilities fails on a GPU).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from kvcore import decode, encode
from tests.workers.engine import start_worker
from tests.workers.harness import StepDriver
from workers.protocol import StepResult
from workers.sampler import Sampler
from workers.sampling import SamplingParams
from workers.worker import WorkerOptions

PROMPTS = [list(b"The quick brown fox"), list(b"jumps over")]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, max_tokens=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@contextmanager
def default_device(device: str):
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def run_steps(
    backend_name: str, *, implicit_device: str | None, model: str | None = None
) -> list[dict[str, list[int]]]:
    options = WorkerOptions(
        model=model, kv_cache_memory_bytes=8 << 20, attention_backend=backend_name
    )
    worker = start_worker(options, "BLHNC")

    def execute(plan):
        if implicit_device is None:
            return decode(worker.execute(encode(plan)), StepResult)
        with default_device(implicit_device):
            return decode(worker.execute(encode(plan)), StepResult)

    driver = StepDriver(worker.runner.config, execute)
    requests = [(f"r{i}", p, 4) for i, p in enumerate(PROMPTS)]
    seeded = driver.generate(requests, chunk=5, sampling=SEEDED)
    greedy = driver.generate([(f"g{i}", p, 4) for i, p in enumerate(PROMPTS)], sampling=GREEDY)
    return [seeded, greedy]


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_no_step_tensor_falls_back_to_the_default_device(backend_name):
    expected = run_steps(backend_name, implicit_device=None)
    assert run_steps(backend_name, implicit_device="meta") == expected


def test_the_meta_default_catches_a_tensor_made_without_a_device():
    def careless_step():
        positions = torch.arange(4)  # no device: lands on the default
        return (torch.ones(4, device="cpu") + positions).tolist()

    with default_device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        careless_step()


def test_sampler_generators_are_made_for_the_logits_device(monkeypatch):
    made = []
    real_generator = torch.Generator

    def recording_generator(*args, **kwargs):
        made.append(kwargs.get("device", args[0] if args else "<default>"))
        return real_generator(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", recording_generator)
    logits = torch.randn(3, 40, generator=real_generator().manual_seed(0))
    sampler = Sampler(logits.device)
    for request_id in ("a", "b"):
        sampler.add_request(request_id, SEEDED)
    params = [SEEDED, SEEDED, SamplingParams(temperature=0.5)]
    with default_device("meta"):
        tokens = sampler.sample(logits, ["a", "b", "c"], params)
    assert tokens.device == logits.device and tokens.dtype == torch.int64
    assert made and all(torch.device(device) == logits.device for device in made)


@pytest.mark.gpu
def test_sampling_on_the_gpu_at_a_positive_temperature():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", 0)
    logits = torch.randn(8, 1000, device=device)
    sampler = Sampler(device)
    sampler.add_request("seeded", SEEDED)
    params = [SEEDED] + [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * 7
    tokens = sampler.sample(logits, ["seeded"] + [f"r{i}" for i in range(7)], params)
    assert tokens.device == device and bool(((tokens >= 0) & (tokens < 1000)).all())
