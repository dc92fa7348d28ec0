"""The settings every tensor-parallel rank reads, defined once: the engine configuration
(``cluster.config.EngineConfig``) extends them with the scheduler's and the servers', and
each rank's ``WorkerOptions`` with where it runs. Nothing copies a field by hand: a rank's
options are the engine's settings projected onto these fields (``WorkerOptions.of``).

Each field's help text, and how the command line spells it when that is not ``--field-name``,
sit beside it (``setting``); ``cluster.cli.flags`` makes every ``kvray`` flag from them, so a
flag's default is always the field's.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvcore.dtypes import MODEL_DTYPES
from workers.kinds import StateCaching
from workers.speculative_config import SpeculativeConfig, parse_speculative_config
from workers.stages import PipelineStage

KV_CACHE_DTYPES = ("auto", *MODEL_DTYPES)


def setting(description: str, **cli) -> msgspec.Meta:
    """A setting's help text and its command-line spelling: ``flag`` (when not
    ``--field-name``), ``aliases``, ``env`` (the KVRAY_* variable giving its default),
    ``choices``, ``parse`` ("bytes": sizes such as 512MiB; "port_or_off"), ``default_text``
    (the default in words), ``command_default`` (what the command line defaults to when that
    differs from the field's: kvray serve turns the HTTP API on), ``group`` ("server": only
    commands that serve have it)."""
    return msgspec.Meta(description=description, extra=cli)


class RankSettings(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[
        str | None,
        setting(
            "a Hugging Face model directory, a .gguf file, or embedded:tiny, embedded:20m, "
            "embedded:smollm2",
            env="KVRAY_MODEL",
            default_text="embedded:tiny",
        ),
    ] = None
    tensor_parallel_size: Annotated[
        int, setting("TP ranks, one worker actor each", aliases=("-tp",))
    ] = 1
    block_size: Annotated[int, setting("tokens per KV block")] = 16
    attention_backend: Annotated[
        str | None,
        setting(
            "torch or triton (on CPUs triton runs in its interpreter: for tests)",
            env="KVRAY_ATTENTION_BACKEND",
            default_text="triton on GPU workers, torch on CPU ones",
        ),
    ] = None
    dtype: Annotated[
        str | None,
        setting(
            "the dtype the model runs in (weights, activations; the KV cache unless "
            "--kv-cache-dtype says otherwise)",
            choices=MODEL_DTYPES,
            default_text="the checkpoint's",
        ),
    ] = None
    kv_cache_dtype: Annotated[
        str,
        setting(
            "attention KV cache storage: auto (the model's dtype), or float16/bfloat16 to "
            "halve a float32 model's cache (attention still computes in float32 on CPUs)",
            choices=KV_CACHE_DTYPES,
        ),
    ] = "auto"
    quantization: Annotated[
        str | None,
        setting(
            "gguf: keep a GGUF's Q4_0/Q4_1/Q8_0 weights in their blocks and multiply them "
            "as such (GPU workers; CPU workers at float32); none: dequantize every weight to "
            "--dtype",
            choices=("gguf", "none"),
            default_text="gguf for a GGUF on GPU workers and float32 CPU workers, else none",
        ),
    ] = None
    kv_cache_memory_bytes: Annotated[
        int,
        setting(
            "KV cache size per rank on CPU workers, e.g. 512MiB; ignored on GPUs",
            flag="--kv-cache-memory",
            env="KVRAY_KV_CACHE_MEMORY",
            parse="bytes",
        ),
    ] = 1 << 30
    gpu_memory_utilization: Annotated[
        float, setting("share of each GPU kvray uses (weights, activations and cache)")
    ] = 0.9
    max_num_batched_tokens: Annotated[
        int, setting("tokens per engine step (prefills are chunked to fit)")
    ] = 2048
    max_num_seqs: Annotated[int, setting("requests running at once")] = 256
    enforce_eager: Annotated[
        bool,
        setting(
            "GPU workers: run every decode step eagerly instead of replaying it from a CUDA "
            "graph captured at startup (graphs of 1, 2, 4, 8, 16, ... requests, up to "
            "--max-num-seqs or 256)"
        ),
    ] = False
    enable_prefix_caching: Annotated[
        bool, setting("reuse the KV cache of shared prompt prefixes")
    ] = True
    enable_expert_parallel: Annotated[
        bool,
        setting(
            "MoE models: each TP rank holds whole experts (num_experts / TP of them) instead "
            "of a slice of every expert"
        ),
    ] = False
    speculative_config: Annotated[
        str | None,
        setting(
            'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
            '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M} '
            "drafts K tokens from the request's own earlier text",
            default_text="off",
        ),
    ] = None
    # Hybrids keep a Mamba state for the prefix cache every this many tokens: small enough
    # that short shared prefixes (a system prompt) hit; each kept state costs one state page
    # per layer.
    mamba_state_interval: Annotated[
        int,
        setting(
            "hybrid models: tokens between the Mamba states kept for prefix caching, a "
            "multiple of --block-size; a shared prefix hits at its last multiple of it"
        ),
    ] = 128

    def __post_init__(self) -> None:
        checks = {
            "tensor_parallel_size": self.tensor_parallel_size >= 1,
            "block_size": self.block_size >= 1,
            "mamba_state_interval": self.mamba_state_interval >= 1
            and self.mamba_state_interval % max(self.block_size, 1) == 0,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "gpu_memory_utilization": 0 < self.gpu_memory_utilization <= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid engine settings: {', '.join(bad)} (got {self})")
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config)  # says what is wrong
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not served (quantized KV caches "
                f"such as fp8 are not built yet); choose one of {', '.join(KV_CACHE_DTYPES)}"
            )

    @classmethod
    def default(cls, name: str):
        """A field's default (the one definition of it)."""
        return next(f.default for f in msgspec.structs.fields(cls) if f.name == name)

    def model_dtype(self, checkpoint_dtype: str) -> str:
        """The dtype the model runs in: --dtype, else the checkpoint's."""
        return self.dtype or checkpoint_dtype

    def cache_dtype(self, checkpoint_dtype: str) -> str:
        """The dtype attention caches are stored in: --kv-cache-dtype, else the model's."""
        if self.kv_cache_dtype == "auto":
            return self.model_dtype(checkpoint_dtype)
        return self.kv_cache_dtype

    def backend_on(self, use_gpu: bool) -> str:
        """The attention backend: the one asked for, else triton on GPUs and torch on CPUs."""
        return self.attention_backend or ("triton" if use_gpu else "torch")

    def group_layout(self) -> dict[str, bool]:
        """How the TP group splits the model beyond its heads (``workers.parallel``)."""
        return {"expert_parallel": self.enable_expert_parallel}

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config, parsed (None: off)."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts a request may carry into one step (0: no speculative decoding)."""
        speculative = self.speculative
        return 0 if speculative is None else speculative.num_speculative_tokens

    def state_caching(self) -> StateCaching | None:
        """How Mamba layers keep states for the prefix cache (None: caching is off)."""
        if not self.enable_prefix_caching:
            return None
        return StateCaching(self.mamba_state_interval, self.max_num_batched_tokens)


class WorkerOptions(RankSettings, frozen=True, kw_only=True):
    """One rank's options: the settings, and where it runs."""

    # "cuda" when the placement reserved a GPU (then a missing GPU is an error), "cpu", or
    # None: GPU 0 when torch sees one, else the CPU.
    device: str | None = None
    num_threads: int | None = None  # torch threads (a Ray actor's CPUs); None: torch's default
    # The decoder layers this rank holds; None: all of them (no pipeline parallelism).
    pipeline_stage: PipelineStage | None = None

    @classmethod
    def of(cls, settings: RankSettings, **placement) -> WorkerOptions:
        """``settings`` (an engine configuration, say) as a rank's options, with
        ``placement`` (device, num_threads)."""
        shared = {name: getattr(settings, name) for name in RankSettings.__struct_fields__}
        return cls(**shared, **placement)
