"""One tensor-parallel rank: the model shard, its KV cache and its runner.

Usable in-process (tests, a single-process engine) and as the body of a Ray actor
(``workers.actor``). Messages in and out are msgspec bytes, so the controller never needs this
process's Python objects.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.backends import get_attention_backend
from kvcore import KVCacheConfig, RankReport, decode, encode
from workers.default_model import is_embedded, load_default_weights, model_config_for
from workers.kv_cache import allocate_kv_cache
from workers.kv_specs import rank_kv_cache_specs
from workers.loader import load_weights
from workers.model_config import ModelConfig
from workers.models import model_class_for
from workers.parallel import destroy_tp_group, get_tp_group, init_tp_group
from workers.profiling import profile_forward
from workers.runner import ModelRunner
from workers.step_plan import StepPlan

logger = logging.getLogger(__name__)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WorkerOptions:
    model: str | None = None  # a Hugging Face directory, or "embedded:NAME"; None = default
    tensor_parallel_size: int = 1
    block_size: int = 16
    attention_backend: str = "torch"
    dtype: str | None = None  # None: the checkpoint's dtype
    kv_cache_memory_bytes: int | None = None  # the CPU budget (ignored on CUDA)
    gpu_memory_utilization: float = 0.9
    device: str | None = None  # None: CUDA when available, else CPU
    max_num_batched_tokens: int = 2048  # the largest step, for the memory profile


class Worker:
    def __init__(self, rank: int, options: WorkerOptions):
        self.rank = rank
        self.options = options
        self.device = torch.device(
            options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.backend = get_attention_backend(options.attention_backend)
        self.model_config: ModelConfig = model_config_for(options.model)
        self.model = None
        self.runner: ModelRunner | None = None
        self._raw_kv_cache: torch.Tensor | None = None

    # -- startup ---------------------------------------------------------------------------

    def init_tp_group(self, init_method: str | None) -> int:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_tp_group(self.rank, self.options.tensor_parallel_size, init_method)
        return self.rank

    def load_model(self) -> None:
        started = time.perf_counter()
        dtype = TORCH_DTYPES[self.options.dtype or self.model_config.dtype]
        with torch.device(self.device):
            model = model_class_for(self.model_config)(self.model_config, dtype)
        if is_embedded(self.options.model):
            load_default_weights(model)
        else:
            load_weights(model, Path(self.options.model), show_progress=self.rank == 0)
        self.model = model.eval()
        logger.info("rank %d loaded the model in %.1f s", self.rank, time.perf_counter() - started)

    def kv_cache_dtype(self) -> str:
        return self.options.dtype or self.model_config.dtype

    def report_specs(self) -> bytes:
        """This rank's layer specs, the backend's layouts and its free cache memory."""
        tp = get_tp_group()
        specs = rank_kv_cache_specs(
            self.model_config,
            self.options.block_size,
            tp.world_size,
            tp.rank,
            customize_spec=self.backend.customize_spec,
            kv_cache_dtype=self.kv_cache_dtype(),
        )
        report = RankReport(
            rank=tp.rank,
            specs=specs,
            supported_layouts=[layout.name for layout in self.backend.supported_kv_cache_layouts()],
            free_memory_bytes=self._free_cache_memory(),
        )
        return encode(report)

    def _free_cache_memory(self) -> int:
        """On CPU, the explicit budget; on CUDA, what is left of the device's allowed share
        after the weights and a profiling forward."""
        if self.device.type != "cuda":
            if self.options.kv_cache_memory_bytes is None:
                raise ValueError("On CPU the KV cache budget must be given (--kv-cache-memory).")
            return self.options.kv_cache_memory_bytes
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_forward(self.model, self.options.max_num_batched_tokens, self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        # The weights and a full-budget forward's activations are not the cache's to use.
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(0, int(total * self.options.gpu_memory_utilization) - peak)

    def allocate_kv_cache(self, config_bytes: bytes) -> int:
        config = decode(config_bytes, KVCacheConfig)
        self._raw_kv_cache = allocate_kv_cache(
            config, self.model.attention_layers(), self.backend, self.device
        )
        self.runner = ModelRunner(self.model, self.backend, config, self.device)
        return self._raw_kv_cache.numel()

    # -- serving ---------------------------------------------------------------------------

    def execute(self, plan_bytes: bytes) -> bytes:
        if self.runner is None:
            raise RuntimeError("execute() before allocate_kv_cache()")
        return encode(self.runner.execute(decode(plan_bytes, StepPlan)))

    def health(self) -> dict:
        return {
            "rank": self.rank,
            "model_loaded": self.model is not None,
            "kv_cache_bytes": 0 if self._raw_kv_cache is None else self._raw_kv_cache.numel(),
            "num_requests": 0 if self.runner is None else len(self.runner.requests),
            "device": str(self.device),
        }

    def shutdown(self) -> None:
        destroy_tp_group()
