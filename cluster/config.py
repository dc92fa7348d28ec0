"""Engine configuration: one frozen struct, filled from ``kvray`` flags (made from its fields
by ``cluster.cli.flags``) and ``KVRAY_*`` environment variables (read in ``cluster.env``),
with vLLM's flag names where they overlap. It extends the settings every worker reads
(``workers.options.RankSettings``) with the scheduler's, the servers' and placement's."""

from __future__ import annotations

from typing import Annotated

import msgspec

from cluster.serve.routing import POLICIES
from cluster.transport import STEP_TRANSPORTS
from workers.options import RankSettings, WorkerOptions, setting
from workers.stages import PipelineStage, split_layers

# The --tool-call-parser names (cluster.tools.parsers holds them; the config loads nothing).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class EngineConfig(RankSettings, frozen=True, kw_only=True):
    max_model_len: Annotated[
        int | None,
        setting("longest prompt + output in tokens", default_text="the model's"),
    ] = None
    kv_cache_layout: Annotated[
        str | None,
        setting(
            "LBHNC LBNHC LHBNC BLHNC BLNHC BHLNC, or NHD/HND",
            env="KVRAY_KV_CACHE_LAYOUT",
            default_text="the backend's first choice",
        ),
    ] = None
    num_gpu_blocks_override: Annotated[
        int | None, setting("use exactly this many KV blocks (testing)", default_text="none")
    ] = None
    max_queue_len: Annotated[
        int, setting("waiting requests before new ones are refused (RESOURCE_EXHAUSTED)")
    ] = 1024
    placement_strategy: Annotated[
        str, setting("how TP ranks spread over nodes", choices=PLACEMENT_STRATEGIES)
    ] = "PACK"
    pipeline_parallel_size: Annotated[
        int,
        setting(
            "pipeline stages: the decoder layers split into this many contiguous runs, each "
            "held by a group of TP ranks (KVRAY_PP_LAYER_PARTITION=a,b,... names each "
            "stage's count)",
            aliases=("-pp",),
        ),
    ] = 1
    pp_layer_partition: Annotated[
        str | None,
        setting(
            "decoder layers per pipeline stage, a,b,... (they must sum to the model's layers)",
            env="KVRAY_PP_LAYER_PARTITION",
            default_text="an even split",
        ),
    ] = None
    pp_micro_batches: Annotated[
        int | None,
        setting(
            "steps of disjoint requests kept in flight through the pipeline stages, so each "
            "stage works while the others do (1: one step at a time)",
            default_text="one per stage",
        ),
    ] = None
    # Ray Compiled Graphs' channel readers spin on a core each (0.97 of a core, idle,
    # measured on Ray 2.60): fine beside a GPU, a core taken from torch on a CPU worker, whose
    # steps go over a TCP connection per rank instead (0.06 ms between steps at the worker,
    # against 0.6 ms with actor calls).
    step_transport: Annotated[
        str | None,
        setting(
            "how a step reaches the worker actors: compiled_graph (Ray Compiled Graphs, "
            "shared-memory channels), socket (a TCP connection from the controller to each "
            "rank, on a port the rank picks) or actor_calls (one actor call per rank and step)",
            choices=tuple(STEP_TRANSPORTS),
            default_text="compiled_graph with GPU workers, socket with CPU ones",
        ),
    ] = None
    # CPUs (and torch threads) per worker; None: 1 beside a GPU, else the controller's node
    # divided among the ranks.
    cpus_per_worker: Annotated[
        int | None,
        setting(
            "CPUs each worker reserves and computes with",
            default_text="1 beside a GPU; on CPU-only clusters, this node's CPUs divided "
            "among the TP ranks",
        ),
    ] = None
    host: Annotated[
        str,
        setting(
            "address the servers bind (0.0.0.0 for every interface)",
            env="KVRAY_HOST",
            group="server",
        ),
    ] = "127.0.0.1"
    port: Annotated[
        int, setting("gRPC port (0 picks a free one)", env="KVRAY_PORT", group="server")
    ] = DEFAULT_PORT
    # The OpenAI-compatible HTTP API; None: off. kvray serve turns it on at 8000.
    http_port: Annotated[
        int | None,
        setting(
            "port of the OpenAI-compatible HTTP API (0 picks a free one; 'off' serves gRPC only)",
            parse="port_or_off",
            command_default=DEFAULT_HTTP_PORT,
            group="server",
        ),
    ] = None
    served_model_name: Annotated[
        str | None,
        setting("the model's name in the APIs", default_text="the --model value", group="server"),
    ] = None
    api_key: Annotated[
        str | None,
        setting(
            "require 'authorization: Bearer <key>' on every gRPC call but health and on the "
            "HTTP /v1 routes",
            env="KVRAY_API_KEY",
            default_text="none",
            group="server",
        ),
    ] = None
    # 4 MiB is gRPC's own default, and more than any context holds as text.
    max_request_body_bytes: Annotated[
        int,
        setting(
            "the largest request either API reads, e.g. 8MiB: bigger HTTP bodies get 413 "
            "before they are parsed, bigger gRPC messages RESOURCE_EXHAUSTED",
            flag="--max-request-body",
            parse="bytes",
            group="server",
        ),
    ] = 4 << 20
    tool_call_parser: Annotated[
        str | None,
        setting(
            'how to find tool calls in what the model writes, for tool_choice "auto": hermes '
            "(Qwen, Hermes...) or llama3_json (Llama 3.x)",
            choices=TOOL_CALL_PARSERS,
            default_text='none: "auto" is refused',
            group="server",
        ),
    ] = None
    # vLLM's flag, taken so its command lines work: --tool-call-parser alone turns "auto" on.
    enable_auto_tool_choice: Annotated[
        bool,
        setting("accepted for vLLM compatibility; needs --tool-call-parser", group="server"),
    ] = False
    drain_timeout_s: Annotated[
        float,
        setting(
            "on SIGTERM, seconds in-flight requests may take to finish before they are aborted",
            flag="--drain-timeout",
            group="server",
        ),
    ] = 30.0
    max_rebuild_attempts: Annotated[
        int,
        setting(
            "after a worker is lost, rebuild the worker group up to this many times before "
            "giving up (0: stop at the first)",
            group="server",
        ),
    ] = 3
    data_parallel_size: Annotated[
        int,
        setting(
            "engine replicas behind the endpoint, each with its own TP worker group, on Ray "
            "Serve (1: one engine, no Serve)",
            aliases=("-dp",),
            group="server",
        ),
    ] = 1
    routing_policy: Annotated[
        str,
        setting(
            "how replicas are picked: kv-aware (the longest cached prefix, unless "
            "overloaded), round-robin or power-of-two",
            choices=POLICIES,
            group="server",
        ),
    ] = "kv-aware"
    autoscale: Annotated[
        str | None,
        setting(
            "MIN:MAX replicas, scaled by Serve on requests in flight (instead of a fixed "
            "--data-parallel-size)",
            default_text="off",
            group="server",
        ),
    ] = None
    target_ongoing_requests: Annotated[
        int,
        setting(
            "with --autoscale: the requests in flight per replica to scale toward", group="server"
        ),
    ] = 16
    # Not flags: set by the code that places the workers.
    placement_timeout_s: float = 120.0
    use_gpu: bool | None = None  # None: when the Ray cluster has GPUs

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "drain_timeout_s": self.drain_timeout_s >= 0,
            "max_rebuild_attempts": self.max_rebuild_attempts >= 0,
            "cpus_per_worker": self.cpus_per_worker is None or self.cpus_per_worker >= 1,
            "port": 0 <= self.port < 65536,
            "http_port": self.http_port is None or 0 <= self.http_port < 65536,
            "max_request_body_bytes": self.max_request_body_bytes >= 1,
            "placement_strategy": self.placement_strategy in PLACEMENT_STRATEGIES,
            "step_transport": self.step_transport in (None, *STEP_TRANSPORTS),
            "data_parallel_size": self.data_parallel_size >= 1,
            "pipeline_parallel_size": self.pipeline_parallel_size >= 1,
            "pp_micro_batches": self.pp_micro_batches is None or self.pp_micro_batches >= 1,
            "routing_policy": self.routing_policy in POLICIES,
            "autoscale": self.autoscale is None or _replica_range(self.autoscale) is not None,
            "target_ongoing_requests": self.target_ongoing_requests >= 1,
            "tool_call_parser": self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
        }
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser "
                f"(one of {', '.join(TOOL_CALL_PARSERS)})"
            )
        if self.pipeline_parallel_size > 1 and self.step_transport == "compiled_graph":
            raise ValueError(
                "--step-transport compiled_graph does not serve pipeline stages; use socket "
                "(the default with --pipeline-parallel-size) or actor_calls"
            )
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid engine settings: {', '.join(bad)} (got {self})")

    def pipeline_stages(self, num_layers: int) -> list[PipelineStage] | None:
        """The stages a model of ``num_layers`` decoder layers is split into (None: one,
        no pipeline parallelism); a split that cannot be made is refused by name."""
        if self.pipeline_parallel_size == 1:
            return None
        return split_layers(num_layers, self.pipeline_parallel_size, self.pp_layer_partition)

    @property
    def micro_batches(self) -> int | None:
        """Steps the engine keeps in flight through the pipeline stages, each of requests the
        others do not sample for (None at PP 1, where a step planned while one runs carries
        the same requests on: ``SchedulerConfig.micro_batches``)."""
        if self.pipeline_parallel_size == 1:
            return None
        return self.pp_micro_batches or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Worker actors in the group: TP ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_replicas(self) -> bool:
        """Whether Serve runs replicas (else one engine in one controller, no Serve)."""
        return self.data_parallel_size > 1 or self.autoscale is not None

    @property
    def replica_range(self) -> tuple[int, int] | None:
        """--autoscale's (min, max) replicas; None without it."""
        return None if self.autoscale is None else _replica_range(self.autoscale)

    def for_workers_on(self, *, use_gpu: bool) -> EngineConfig:
        """These settings with the defaults that depend on the workers' device filled in."""
        # Through pipeline stages, step channels: no compiled graph serves them.
        graphs = use_gpu and self.pipeline_parallel_size == 1
        transport = self.step_transport or ("compiled_graph" if graphs else "socket")
        return msgspec.structs.replace(
            self,
            attention_backend=self.backend_on(use_gpu),
            use_gpu=use_gpu,
            step_transport=transport,
        )

    def worker_options(
        self,
        device: str | None = None,
        num_threads: int | None = None,
        pipeline_stage: PipelineStage | None = None,
    ) -> WorkerOptions:
        """Each TP rank's options: these settings on ``device`` ("cuda" when the rank's
        placement reserved a GPU, "cpu", or None: any) with ``num_threads`` torch threads
        (None: torch's default), holding ``pipeline_stage``'s layers (None: all)."""
        if self.attention_backend is None:
            raise ValueError("worker_options() of settings not yet resolved by for_workers_on()")
        return WorkerOptions.of(
            self, device=device, num_threads=num_threads, pipeline_stage=pipeline_stage
        )


def _replica_range(text: str) -> tuple[int, int] | None:
    """``"1:4"`` -> (1, 4); None when it is no such range."""
    low, _, high = text.partition(":")
    if not (low.strip().isdigit() and high.strip().isdigit()):
        return None
    low, high = int(low), int(high)
    return (low, high) if 1 <= low <= high else None
