"""One tensor-parallel rank: the model shard, its KV cache and its runner.

Usable in-process (tests, a single-process engine) and as the body of a Ray actor
(``workers.actor``). Messages in and out are msgspec bytes, so the controller never needs this
process's Python objects.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import torch
from torch import nn

from kernels.attention import get_attention_backend
from kvcore import KVCacheConfig, RankReport, decode, encode
from kvcore.views import TORCH_DTYPES
from workers.default_model import load_default_weights
from workers.device import distributed_backend, select_device
from workers.gguf import load_gguf_weights, read_metadata
from workers.grammar.vocabulary import grammar_vocabulary
from workers.group_step import StepLimits
from workers.kv_cache import allocate_kv_cache
from workers.kv_specs import rank_kv_cache_specs
from workers.layers.cpu_matmul import pack_linear_weights
from workers.loader import load_weights
from workers.memory import CudaMemoryProbe, MemorySnapshot, kv_cache_budget
from workers.model_config import ModelConfig
from workers.model_source import gguf_path_for, is_embedded, load_tokenizer_for, model_config_for
from workers.models.registry import model_class_for
from workers.options import WorkerOptions
from workers.parallel import (
    destroy_tp_group,
    get_tp_group,
    init_stage_groups,
    init_tp_group,
    recv_from_previous_stage,
    send_to_next_stage,
)
from workers.profiling import run_profile_step
from workers.protocol import StepPlan, StepResult
from workers.quantization import keep_quantized, keeps_quantized, plan_quantized
from workers.runner import ModelRunner
from workers.shard_report import shard_report
from workers.stage_wire import StageStep

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, rank: int, options: WorkerOptions):
        self.rank = rank
        self.options = options
        if options.num_threads is not None:
            torch.set_num_threads(options.num_threads)  # Ray's OMP_NUM_THREADS would say 1
        self.device = select_device(options.device)
        # Measures the device around startup to size the cache; None on CPUs, whose cache
        # size is given.
        self.memory = CudaMemoryProbe(self.device) if self.device.type == "cuda" else None
        self._memory_before_load: MemorySnapshot | None = None
        # Each kind of cache layer takes its kernels of this backend's name (workers.kinds).
        self.backend = get_attention_backend(options.backend_on(self.device.type == "cuda"))
        self.model_config: ModelConfig = model_config_for(options.model)
        self.model = None
        self._dtype: torch.dtype | None = None  # the weights' and hidden states', once loaded
        self.runner: ModelRunner | None = None
        self._replied_at: float | None = None  # when this rank last answered a step
        self._raw_kv_cache: torch.Tensor | None = None

    # -- startup ---------------------------------------------------------------------------

    def init_tp_group(self, init_method: str | None) -> int:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_tp_group(
            self.rank,
            self.options.tensor_parallel_size,
            init_method,
            backend=distributed_backend(self.device),
            **self.options.group_layout(),
        )
        return self.rank

    def init_stage_groups(self, init_method: str) -> int:
        """Join the group of every stage's ranks (``workers.parallel.init_stage_groups``):
        this stage's collectives in a subgroup, its hidden states sent point to point."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        stage = self.options.pipeline_stage
        init_stage_groups(
            self.rank,
            self.options.tensor_parallel_size,
            stage.index,
            stage.count,
            init_method,
            backend=distributed_backend(self.device),
            **self.options.group_layout(),
        )
        return self.rank

    def load_model(self) -> None:
        started = time.perf_counter()
        if self.memory is not None:
            self.memory.release_cached()
            self.memory.reset_peak()
            self._memory_before_load = self.memory.snapshot()
        dtype = TORCH_DTYPES[self.options.model_dtype(self.model_config.dtype)]
        self._dtype = dtype
        with torch.device(self.device):
            model = model_class_for(self.model_config)(
                self.model_config, dtype, self.options.pipeline_stage
            )
        gguf = gguf_path_for(self.options.model)
        if gguf is not None:
            self._load_gguf(model, gguf, dtype)
        elif is_embedded(self.options.model):
            load_default_weights(model)
        else:
            load_weights(model, Path(self.options.model), show_progress=self.rank == 0)
        pack_linear_weights(model)  # on GPUs only the layers kept quantized change
        self.model = model.eval()
        logger.info("rank %d loaded the model in %.1f s", self.rank, time.perf_counter() - started)

    def _load_gguf(self, model: nn.Module, path: Path, dtype: torch.dtype) -> None:
        keep = keeps_quantized(
            self.options.quantization, is_gguf=True, device=self.device, dtype=dtype
        )
        plan = plan_quantized(model, read_metadata(path)) if keep else {}
        if plan:
            size = keep_quantized(model, plan, self.device)
            logger.info(
                "rank %d keeps %d GGUF tensors quantized (%.1f MiB)",
                self.rank,
                len(plan),
                size / 2**20,
            )
        load_gguf_weights(model, path, keep_quantized=plan, show_progress=self.rank == 0)

    def report_shards(self) -> bytes:
        """What this rank holds of the model's split modules beyond its KV geometry (which
        ``report_specs`` tells), for the startup check that the ranks add up to the model."""
        return encode(shard_report(self.model))

    def report_specs(self) -> bytes:
        """This rank's layer specs, the backend's layouts and its free cache memory."""
        tp = get_tp_group()
        specs = rank_kv_cache_specs(
            self.model_config,
            self.options.block_size,
            tp.world_size,
            tp.rank,
            customize_spec=self.backend.customize_spec,
            kv_cache_dtype=self.options.cache_dtype(self.model_config.dtype),
            state_caching=self.options.state_caching(),
            model_dtype=self.options.model_dtype(self.model_config.dtype),
            num_speculative_tokens=self.options.num_speculative_tokens,
            layers=self._stage_layers(),
        )
        report = RankReport(
            rank=tp.rank,
            specs=specs,
            supported_layouts=[layout.name for layout in self.backend.supported_kv_cache_layouts()],
            free_memory_bytes=self._free_cache_memory(specs),
        )
        return encode(report)

    def _stage_layers(self) -> range | None:
        """The decoder layers of this rank's pipeline stage (None: all)."""
        stage = self.options.pipeline_stage
        return None if stage is None else stage.layers

    def _free_cache_memory(self, specs) -> int:
        """On CPU, the explicit budget; on a GPU, its allowed share less the weights, a
        full-size step's peak and what grew outside PyTorch's allocator (``workers.memory``)."""
        if self.memory is None:
            if self.options.kv_cache_memory_bytes is None:
                raise ValueError("On CPU the KV cache budget must be given (--kv-cache-memory).")
            return self.options.kv_cache_memory_bytes
        if self._memory_before_load is None:
            raise RuntimeError("report_specs() before load_model()")
        started = time.perf_counter()
        scratch_bytes = run_profile_step(
            self.model,
            self.backend,
            specs,
            num_tokens=self.options.max_num_batched_tokens,
            num_seqs=self.options.max_num_seqs,
            max_len=self.model_config.max_position_embeddings,
            device=self.device,
        )
        self.memory.release_cached()
        budget = kv_cache_budget(
            self._memory_before_load,
            self.memory.snapshot(),
            self.options.gpu_memory_utilization,
            scratch_bytes,
        )
        logger.info(
            "rank %d: memory profile took %.1f s; %s",
            self.rank,
            time.perf_counter() - started,
            budget.describe(),
        )
        return budget.kv_cache_bytes

    def allocate_kv_cache(self, config_bytes: bytes) -> int:
        config = decode(config_bytes, KVCacheConfig)
        self._raw_kv_cache = allocate_kv_cache(
            config, self.model.kv_cache_layers(), self.backend, self.device
        )
        limits = StepLimits(self.options.max_num_batched_tokens, self.options.max_num_seqs)
        self.runner = ModelRunner(
            self.model,
            self.backend,
            config,
            self.device,
            limits,
            self._grammar_vocabulary,
        )
        if self.device.type == "cuda" and not self.options.enforce_eager:
            self.runner.use_decode_graphs()
        return self._raw_kv_cache.numel()

    def _grammar_vocabulary(self):
        """What constrained requests' grammars were compiled against: the tokenizer the
        controller has (``cluster.assembly``), over the model's logits."""
        config = self.model_config
        tokenizer = load_tokenizer_for(self.options.model, config.eos_token_ids)
        return grammar_vocabulary(tokenizer, config.vocab_size, tokenizer.eos_token_ids)

    # -- serving ---------------------------------------------------------------------------

    def execute(self, plan_bytes: bytes) -> bytes:
        if self.runner is None:
            raise RuntimeError("execute() before allocate_kv_cache()")
        started = time.perf_counter()
        result = self.runner.execute(decode(plan_bytes, StepPlan))
        waited = 0.0 if self._replied_at is None else max(0.0, started - self._replied_at)
        self._replied_at = time.perf_counter()
        timed = msgspec.structs.replace(
            result, step_seconds=self._replied_at - started, waited_seconds=waited
        )
        return encode(timed)

    def run_stage(
        self,
        plan_bytes: bytes,
        hidden: torch.Tensor | None = None,
        owed: list[tuple[bytes, bytes]] = (),
    ):
        """A step on a pipeline stage before the last: its layers' hidden states for the next
        stage (``hidden``: the previous stage's), from TP rank 0; None from the others,
        whose states are the same. ``owed``: plans of earlier steps with the last stage's
        results of them, whose tokens this stage takes first (``take_sampled``)."""
        out = self._stage_forward(decode(plan_bytes, StepPlan), hidden, owed)
        return out.cpu() if get_tp_group().is_first_rank else None

    def _stage_forward(self, plan: StepPlan, hidden: torch.Tensor | None, owed) -> torch.Tensor:
        if self.runner is None:
            raise RuntimeError("a step before allocate_kv_cache()")
        for plan_before, result in owed:
            self.runner.take_sampled(decode(plan_before, StepPlan), decode(result, StepResult))
        if hidden is not None:
            hidden = hidden.to(self.device)
        return self.runner.run_stage(plan, hidden)

    def execute_stage(self, plan_bytes: bytes, hidden: torch.Tensor) -> bytes:
        """A step on the last pipeline stage, from the previous stage's hidden states."""
        return self._last_stage_step(decode(plan_bytes, StepPlan), hidden)

    def _last_stage_step(self, plan: StepPlan, hidden: torch.Tensor) -> bytes:
        if self.runner is None:
            raise RuntimeError("a step before allocate_kv_cache()")
        return encode(self.runner.execute(plan, hidden.to(self.device)))

    def serve_stage(self, frame_bytes: bytes) -> bytes:
        """A step sent over a stage's step channel (``workers.stage_wire``), its hidden
        states taken from the previous stage and sent to the next point to point: the last
        stage answers with the result, the others with nothing."""
        step = decode(frame_bytes, StageStep)
        plan = decode(step.plan, StepPlan)
        stage = self.options.pipeline_stage
        hidden = None if stage.is_first else self._hidden_from_previous_stage(plan)
        if stage.is_last:
            return self._last_stage_step(plan, hidden)
        out = self._stage_forward(plan, hidden, step.owed)
        if get_tp_group().is_first_rank and plan.num_scheduled_tokens:
            if out.dtype != self._dtype:  # the next stage receives the model's dtype
                raise RuntimeError(f"stage output in {out.dtype}, not {self._dtype}")
            send_to_next_stage(out)
        return b""

    def _hidden_from_previous_stage(self, plan: StepPlan) -> torch.Tensor:
        shape = (plan.num_scheduled_tokens, self.model_config.hidden_size)
        if not plan.num_scheduled_tokens:  # a step that only forgets requests
            return torch.empty(shape, dtype=self._dtype, device=self.device)
        return recv_from_previous_stage(shape, self._dtype, self.device)

    def health(self) -> dict:
        return {
            "rank": self.rank,
            "model_loaded": self.model is not None,
            "kv_cache_bytes": 0 if self._raw_kv_cache is None else self._raw_kv_cache.numel(),
            "num_requests": 0 if self.runner is None else len(self.runner.requests),
            "device": str(self.device),
            "num_threads": torch.get_num_threads(),
        }

    def shutdown(self) -> None:
        destroy_tp_group()
