"""The startup check of a MoE model's expert placement, beside the KV geometry check: every
rank reports what it holds of each MoE layer's experts, and each must hold exactly its share of
the experts the first report's rank implies, split the way the group is configured: whole
experts, ``num_experts / tp`` per rank in rank order (expert parallelism), or a ``1 / tp``
slice of every expert's intermediate dimension. A rank built from another checkpoint or other
settings is named, with the layer and the ranges it holds and should hold."""

from __future__ import annotations

import msgspec

from workers.model_config import ExpertShard, MoEConfig


class ExpertPlacementError(ValueError):
    """The ranks' experts do not add up to the model's."""


class ExpertReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank tells the controller of its MoE layers (none for a dense model)."""

    rank: int
    tp_size: int
    expert_parallel: bool
    layers: dict[str, ExpertShard]  # module name -> what this rank holds of its experts


def check_expert_placements(reports: list[ExpertReport]) -> None:
    if not reports:
        return
    first = min(reports, key=lambda r: r.rank)
    for report in reports:
        if set(report.layers) != set(first.layers):
            raise ExpertPlacementError(
                f"Rank {report.rank} has MoE layers {sorted(report.layers)}; rank "
                f"{first.rank} has {sorted(first.layers)}."
            )
        if (report.tp_size, report.expert_parallel) != (first.tp_size, first.expert_parallel):
            raise ExpertPlacementError(
                f"Rank {report.rank} splits experts over {report.tp_size} ranks "
                f"(expert parallel: {report.expert_parallel}); rank {first.rank} over "
                f"{first.tp_size} (expert parallel: {first.expert_parallel})."
            )
        for layer, shard in report.layers.items():
            moe = _experts_implied_by(first, first.layers[layer])
            expected = moe.placement(report.tp_size, report.rank, report.expert_parallel)
            if shard != expected:
                raise ExpertPlacementError(
                    f"Rank {report.rank}, layer {layer}: holds {_describe(shard)}; expected "
                    f"{_describe(expected)} of {moe.num_experts} experts of "
                    f"{moe.intermediate_size} rows."
                )


def _experts_implied_by(report: ExpertReport, shard: ExpertShard) -> MoEConfig:
    """The layer's whole experts, as one rank's share of them implies."""
    tp = report.tp_size
    if report.expert_parallel:
        num_experts, rows = shard.num_experts * tp, shard.intermediate_size
    else:
        num_experts, rows = shard.num_experts, shard.intermediate_size * tp
    return MoEConfig(
        num_experts=num_experts, top_k=1, intermediate_size=rows, norm_topk_prob=False, layers=()
    )


def _describe(shard: ExpertShard) -> str:
    experts = f"experts [{shard.first_expert}, {shard.first_expert + shard.num_experts})"
    end = shard.intermediate_start + shard.intermediate_size
    return f"{experts}, rows [{shard.intermediate_start}, {end}) of each"
