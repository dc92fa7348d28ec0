"""Bringing a worker group up, the one way every caller does it (the controller's actors, the
in-process engine, the benchmarks and the tests): join the TP group, load the weights, check
that the ranks' experts (MoE models) add up, report each rank's KV specs, plan the cache from
every report, allocate it on every rank.

A rank is anything with the worker's methods behind ``call``: a ``Worker`` in this process
(``LocalRank``) or a Ray actor hosting one (``ActorRank``), so the sequence is written once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from kvcore import KVCacheConfig, RankReport, decode, encode
from workers.expert_placement import ExpertReport, check_expert_placements

Plan = Callable[[list[RankReport]], KVCacheConfig]
StagesPlan = Callable[[list[list[RankReport]]], list[KVCacheConfig]]  # reports by stage


class Rank(Protocol):
    async def call(self, method: str, *args): ...


class LocalRank:
    """A ``workers.worker.Worker`` in this process, called directly."""

    def __init__(self, worker):
        self.worker = worker

    async def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class ActorRank:
    """A Ray actor hosting a worker (``workers.actor``): each call is a remote one."""

    def __init__(self, actor):
        self.actor = actor

    async def call(self, method: str, *args):
        return await getattr(self.actor, method).remote(*args)


async def bring_up(
    ranks: Sequence[Rank], plan: Plan, init_method: str | None = None
) -> KVCacheConfig:
    """Every rank started and holding the cache ``plan`` makes of their reports. The TP
    group meets at ``init_method`` (None: rank 0 picks an address, when there are several)."""
    kv_config = plan(await _joined_loaded_and_reported(ranks, init_method))
    await _on_all(ranks, "allocate_kv_cache", encode(kv_config))
    return kv_config


async def bring_up_stages(
    stage_ranks: Sequence[Sequence[Rank]], plan: StagesPlan, *, linked: bool = True
) -> list[KVCacheConfig]:
    """``bring_up`` for pipeline stages: every rank of every stage joins one group, each
    stage's ranks a TP subgroup of it (``workers.parallel.init_stage_groups``), and ``plan``
    makes every stage's cache from all stages' reports at once (their block counts must
    agree). Without ``linked`` each stage is a TP group alone and sends nothing point to
    point (stages in one process, which can join no group of torch's together)."""
    if linked:
        init_method = await stage_ranks[0][0].call("rendezvous_address")
        everyone = [rank for ranks in stage_ranks for rank in ranks]
        await _on_all(everyone, "init_stage_groups", init_method)
        reported = [_loaded_and_reported(ranks) for ranks in stage_ranks]
    else:
        reported = [_joined_loaded_and_reported(ranks, None) for ranks in stage_ranks]
    reports = list(await asyncio.gather(*reported))
    configs = plan(reports)
    for ranks, kv_config in zip(stage_ranks, configs, strict=True):
        await _on_all(ranks, "allocate_kv_cache", encode(kv_config))
    return configs


async def _joined_loaded_and_reported(
    ranks: Sequence[Rank], init_method: str | None
) -> list[RankReport]:
    if init_method is None and len(ranks) > 1:
        init_method = await ranks[0].call("rendezvous_address")
    await _on_all(ranks, "init_tp_group", init_method)
    return await _loaded_and_reported(ranks)


async def _loaded_and_reported(ranks: Sequence[Rank]) -> list[RankReport]:
    await _on_all(ranks, "load_model")
    experts = [decode(reply, ExpertReport) for reply in await _on_all(ranks, "report_shards")]
    check_expert_placements(experts)
    return [decode(reply, RankReport) for reply in await _on_all(ranks, "report_specs")]


def bring_up_in_process(worker, plan: Plan, init_method: str | None = None) -> KVCacheConfig:
    """``bring_up`` of one worker in this process, from code that runs no event loop."""
    return asyncio.run(bring_up([LocalRank(worker)], plan, init_method))


async def _on_all(ranks: Sequence[Rank], method: str, *args) -> list:
    return list(await asyncio.gather(*(rank.call(method, *args) for rank in ranks)))
