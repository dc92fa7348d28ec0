"""A backend that needs kernel blocks smaller than the scheduler's: the worker splits the
views and still matches transformers."""

from __future__ import annotations

from kernels.attention.torch_backend import TorchAttentionBackend
from tests.workers.engine import KV_CACHE_MEMORY, plan_of, run_requests
from tests.workers.hf_models import PROMPTS, reference_generations, save_model
from workers.bringup import bring_up_in_process
from workers.worker import Worker, WorkerOptions


class TwoTokenKernelBlocks(TorchAttentionBackend):
    name = "torch-2"

    def supported_kernel_block_sizes(self):
        return (2,)


def test_kernel_block_split_matches_transformers(tmp_path):
    model_dir = save_model("qwen3-sliding", tmp_path)
    worker = Worker(
        0, WorkerOptions(model=str(model_dir), block_size=8, kv_cache_memory_bytes=KV_CACHE_MEMORY)
    )
    worker.backend = TwoTokenKernelBlocks()
    bring_up_in_process(worker, lambda reports: plan_of(reports[0], "LBNHC"))
    batch = [[(f"r{i}", p, 12, None) for i, p in enumerate(PROMPTS)]]
    outputs = run_requests(worker, batch, chunk=5)
    some_layer = next(iter(worker.model.kv_cache_layers().values()))
    assert some_layer.kv_cache.shape[2] == 2  # views split into 2-token kernel blocks
    expected = reference_generations(model_dir, PROMPTS, 12)
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected
