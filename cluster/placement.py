"""Where a worker group runs: one placement-group bundle per rank (TP ranks times pipeline
stages, stage by stage), a worker actor on each.

A CPU worker computes with as many torch threads as its bundle holds CPUs (Ray would give a
one-CPU actor one OpenMP thread), so a served model gets what an in-process one gets. By
default a CPU-only group divides the controller's node among its ranks; a GPU rank takes one
CPU beside its GPU. ``--cpus-per-worker`` says otherwise.
"""

from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import EngineConfig
from workers.actor import remote_worker_class
from workers.stages import PipelineStage


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested TP ranks."""


def cpus_per_worker(config: EngineConfig, use_gpu: bool) -> int:
    if config.cpus_per_worker is not None:
        return config.cpus_per_worker
    if use_gpu:
        return 1
    here = ray.get_runtime_context().get_node_id()
    node_cpus = next((n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == here), 1)
    return max(1, int(node_cpus) // config.world_size)


def worker_bundle(use_gpu: bool, num_cpus: int) -> dict[str, float]:
    return {"GPU": 1, "CPU": num_cpus} if use_gpu else {"CPU": num_cpus}


def never_fits(config: EngineConfig, bundle: dict[str, float]) -> str | None:
    """Why the group can never be placed on this cluster, whatever frees up; None when it
    could (waiting then makes sense: resources may be in use, or nodes still joining)."""
    tp = config.world_size
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for name, amount in bundle.items():
        total = sum(node.get(name, 0) for node in nodes)
        if total < amount * tp:
            return f"{tp} rank(s) need {amount * tp:g} {name} in all; the cluster has {total:g}"
    fitting = [node for node in nodes if all(node.get(k, 0) >= v for k, v in bundle.items())]
    if not fitting:
        return f"no node can hold one rank's bundle {bundle}"
    if config.placement_strategy == "STRICT_SPREAD" and len(fitting) < tp:
        return f"STRICT_SPREAD needs {tp} nodes that each hold {bundle}; there are {len(fitting)}"
    holds_all = any(all(node.get(k, 0) >= v * tp for k, v in bundle.items()) for node in nodes)
    if config.placement_strategy == "STRICT_PACK" and not holds_all:
        return f"STRICT_PACK needs one node with {tp} x {bundle}; none has that much"
    return None


async def reserve(config: EngineConfig, bundle: dict[str, float]) -> PlacementGroup:
    tp = config.world_size
    reason = never_fits(config, bundle)
    if reason is not None:
        raise PlacementError(
            f"Cannot place {tp} TP rank(s) of {bundle} each with strategy "
            f"{config.placement_strategy}: {reason}. Lower --tensor-parallel-size or "
            "--cpus-per-worker, or add nodes (see `ray status`)."
        )
    group = placement_group([dict(bundle)] * tp, strategy=config.placement_strategy)
    try:
        await asyncio.wait_for(group.ready(), timeout=config.placement_timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"Could not place {tp} TP rank(s) of {bundle} each with strategy "
            f"{config.placement_strategy} within {config.placement_timeout_s:.0f} s. The "
            f"cluster has {ray.cluster_resources()} in total and {ray.available_resources()} "
            "available. Check `ray status`; --cpus-per-worker or --tensor-parallel-size ask "
            "for less."
        ) from None
    return group


def start_worker_actors(
    config: EngineConfig,
    group: PlacementGroup,
    use_gpu: bool,
    num_cpus: int,
    stages: list[PipelineStage] | None = None,
) -> list:
    """One worker actor per bundle, stage by stage (``stages``: None for one). A rank whose
    bundle reserved a GPU must run on it: its device is "cuda", never a silent CPU
    fallback."""
    # Workers keep OpenMP's own wait policy: their threads spin briefly between the ~300
    # parallel regions of a decode step (torch ops, the GGUF and attention kernels share one
    # pool), then sleep. OMP_WAIT_POLICY=PASSIVE, once set here, woke them from sleep for
    # every region: SmolLM2 decoded one stream at 12-18 tok/s through Ray instead of 24-30.
    actor_class = remote_worker_class(num_cpus=num_cpus, num_gpus=1 if use_gpu else 0)
    device = "cuda" if use_gpu else "cpu"
    tp = config.tensor_parallel_size
    actors = []
    for index, stage in enumerate(stage for stage in stages or [None] for _ in range(tp)):
        options = config.worker_options(device=device, num_threads=num_cpus, pipeline_stage=stage)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        )
        actors.append(actor_class.options(scheduling_strategy=strategy).remote(index % tp, options))
    return actors
