"""``GetServerInfo``: the static plan plus the cache's current occupancy."""

from __future__ import annotations

from cluster.api.v1 import kvray_pb2 as pb
from kvcore import KVCacheConfig


def static_info(
    model: str,
    parallel: tuple[int, int],
    backend: str,
    kv_config: KVCacheConfig,
    vocab_size: int,
) -> dict:
    """The plan's part of the info; ``parallel``: (TP ranks per stage, pipeline stages)."""
    groups = [
        pb.KVCacheGroup(
            layer_names=list(group.layer_names),
            spec_type=type(group.kv_cache_spec).__name__,
            block_size=group.kv_cache_spec.block_size,
            page_size_bytes=group.kv_cache_spec.page_size_bytes,
        )
        for group in kv_config.kv_cache_groups
    ]
    return dict(
        model=model,
        tensor_parallel_size=parallel[0],
        pipeline_parallel_size=parallel[1],
        attention_backend=backend,
        kv_cache_layout=kv_config.layout,
        scheduler_block_size=kv_config.scheduler_block_size,
        hash_block_size=kv_config.hash_block_size,
        groups=groups,
        num_blocks=kv_config.num_blocks,
        capacity_tokens=kv_config.capacity_tokens,
        max_model_len=kv_config.max_model_len,
        max_concurrency=kv_config.max_concurrency,
        vocab_size=vocab_size,
    )


def occupancy(engine) -> dict:
    """What one engine holds and has done now: the numbers every replica reports."""
    scheduler = engine.scheduler
    return dict(
        num_free_blocks=scheduler.coordinator.num_free_blocks,
        num_running_requests=len(scheduler.running),
        num_waiting_requests=len(scheduler.waiting),
        prefix_cache_queried_tokens=scheduler.prefix_queried_tokens,
        prefix_cache_hit_tokens=scheduler.prefix_hit_tokens,
        num_requests_finished=scheduler.num_finished,
        spec_decode_num_drafts=scheduler.speculation.num_drafts,
        spec_decode_num_draft_tokens=scheduler.speculation.num_draft_tokens,
        spec_decode_num_accepted_tokens=scheduler.speculation.num_accepted_tokens,
    )


def server_info(engine, info: dict) -> pb.ServerInfo:
    """One engine's info: the plan, its occupancy, and itself as the one replica."""
    scheduler = engine.scheduler
    groups = []
    for static, hit_tokens in zip(info["groups"], scheduler.prefix_group_hit_tokens, strict=True):
        group = pb.KVCacheGroup()
        group.CopyFrom(static)
        group.prefix_cache_group_hit_tokens = hit_tokens
        groups.append(group)
    numbers = occupancy(engine)
    totals = {k: v for k, v in numbers.items() if k != "num_requests_finished"}
    return pb.ServerInfo(
        **{**info, "groups": groups},
        **totals,
        **engine.stats.summary(),
        data_parallel_size=1,
        replicas=[pb.ReplicaInfo(replica_id="0", **numbers)],
    )
