"""GetServerInfo when replicas serve: the plan each replica runs, the sums of what they hold
and have done, and one entry per replica, from the stats they last published."""

from __future__ import annotations

import statistics

from cluster.api.v1 import kvray_pb2 as pb
from cluster.assembly import served_model_name
from cluster.errors import EngineUnavailableError
from cluster.serve.board import latest_stats
from cluster.server_info import static_info
from kvcore import KVCacheConfig, decode

SUMMED = (
    "num_free_blocks",
    "num_running_requests",
    "num_waiting_requests",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def replica_set_info(config, vocab_size: int) -> pb.ServerInfo:
    stats = dict(sorted(latest_stats().items()))

    if not stats:
        raise EngineUnavailableError("No engine replica has reported yet; retry.")
    plans = [decode(s["plan"], KVCacheConfig) for s in stats.values()]
    static = static_info(
        served_model_name(config),
        (config.tensor_parallel_size, config.pipeline_parallel_size),
        config.backend_on(bool(config.use_gpu)),
        plans[0],
        vocab_size,
    )
    # Blocks and capacity behind the endpoint: every replica's together, as the free blocks
    # are (a total beside a single replica's would read as more free blocks than blocks).
    static |= {
        "num_blocks": sum(plan.num_blocks for plan in plans),
        "capacity_tokens": sum(plan.capacity_tokens for plan in plans),
        "max_concurrency": sum(plan.max_concurrency for plan in plans),
    }
    replicas = [
        pb.ReplicaInfo(replica_id=replica_id, **s["occupancy"]) for replica_id, s in stats.items()
    ]
    summaries = [s["summary"] for s in stats.values()]
    return pb.ServerInfo(
        **static,
        **{name: sum(getattr(r, name) for r in replicas) for name in SUMMED},
        num_steps=sum(s["num_steps"] for s in summaries),
        step_overhead_median_ms=max(s["step_overhead_median_ms"] for s in summaries),
        step_overhead_p99_ms=max(s["step_overhead_p99_ms"] for s in summaries),
        kv_memory_waste=statistics.mean(s["kv_memory_waste"] for s in summaries),
        data_parallel_size=len(replicas),
        routing_policy=config.routing_policy,
        replicas=replicas,
    )
