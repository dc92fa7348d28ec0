"""Engine configuration: one frozen struct, filled from ``kvray serve`` flags and ``KVRAY_*``
environment variables (read in ``cluster.env``), with vLLM's flag names where they overlap."""

from __future__ import annotations

import msgspec

from workers import defaults

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None  # a Hugging Face model directory; None = the embedded default
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = defaults.BLOCK_SIZE
    kv_cache_layout: str | None = None  # None: the attention backend's first choice
    enable_prefix_caching: bool = True
    # Hybrids: tokens between the Mamba states kept for prefix caching (a multiple of
    # block_size); a shared prefix hits at its last multiple of this.
    mamba_state_interval: int = defaults.MAMBA_STATE_INTERVAL
    gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None  # required on CPU-only workers
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_queue_len: int = 1024  # waiting requests beyond this are refused (RESOURCE_EXHAUSTED)
    attention_backend: str | None = None  # None: triton on GPU workers, torch on CPU ones
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 picks a free port
    http_port: int | None = None  # the OpenAI-compatible HTTP API; None: off (kvray serve: 8000)
    served_model_name: str | None = None  # the model's name in the APIs; None: from --model
    api_key: str | None = None
    # The largest request either API reads (HTTP bodies: 413 past it; gRPC messages:
    # RESOURCE_EXHAUSTED); 4 MiB is gRPC's own default and more than any context holds as text.
    max_request_body_bytes: int = 4 << 20
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 120.0
    use_gpu: bool | None = None  # None: when the Ray cluster has GPUs
    # CPUs (and torch threads) per worker; None: 1 beside a GPU, else the controller's node
    # divided among the ranks.
    cpus_per_worker: int | None = None
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may finish
    max_rebuild_attempts: int = 3  # after a lost worker, before the engine gives up

    def __post_init__(self) -> None:
        checks = {
            "tensor_parallel_size": self.tensor_parallel_size >= 1,
            "block_size": self.block_size >= 1,
            "mamba_state_interval": self.mamba_state_interval >= 1
            and self.mamba_state_interval % max(self.block_size, 1) == 0,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
            "drain_timeout_s": self.drain_timeout_s >= 0,
            "max_rebuild_attempts": self.max_rebuild_attempts >= 0,
            "cpus_per_worker": self.cpus_per_worker is None or self.cpus_per_worker >= 1,
            "port": 0 <= self.port < 65536,
            "http_port": self.http_port is None or 0 <= self.http_port < 65536,
            "max_request_body_bytes": self.max_request_body_bytes >= 1,
            "placement_strategy": self.placement_strategy
            in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid engine settings: {', '.join(bad)} (got {self})")

    @classmethod
    def default(cls, name: str):
        """A field's default, for the CLI's help (one definition of each default)."""
        return next(f.default for f in msgspec.structs.fields(cls) if f.name == name)

    def state_caching(self):
        """How Mamba layers keep states for the prefix cache (None: caching is off)."""
        from workers.kv_specs import StateCaching

        if not self.enable_prefix_caching:
            return None
        return StateCaching(self.mamba_state_interval, self.max_num_batched_tokens)

    def for_workers_on(self, *, use_gpu: bool) -> EngineConfig:
        """These settings with the defaults that depend on the workers' device filled in."""
        backend = self.attention_backend or ("triton" if use_gpu else "torch")
        return msgspec.structs.replace(self, attention_backend=backend, use_gpu=use_gpu)

    def worker_options(self, device: str | None = None, num_threads: int | None = None):
        """What each TP rank's worker needs of these settings (a ``WorkerOptions``), on
        ``device`` ("cuda" when the rank's placement reserved a GPU, "cpu", or None: any)
        with ``num_threads`` torch threads (None: torch's default)."""
        from workers.worker import WorkerOptions  # torch-heavy; only engines need it

        if self.attention_backend is None:
            raise ValueError("worker_options() of settings not yet resolved by for_workers_on()")
        return WorkerOptions(
            device=device,
            num_threads=num_threads,
            model=self.model,
            tensor_parallel_size=self.tensor_parallel_size,
            block_size=self.block_size,
            attention_backend=self.attention_backend,
            dtype=self.dtype,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            state_caching=self.state_caching(),
        )
