"""What one rank holds of the model's split modules beyond its KV geometry: today the MoE
layers' experts (``workers.expert_placement`` checks that the ranks' shares add up)."""

from __future__ import annotations

from torch import nn

from workers.expert_placement import ExpertReport
from workers.layers.moe import expert_placements
from workers.parallel import get_tp_group


def shard_report(model: nn.Module) -> ExpertReport:
    tp = get_tp_group()
    return ExpertReport(
        rank=tp.rank,
        tp_size=tp.world_size,
        expert_parallel=tp.expert_parallel,
        layers=expert_placements(model),
    )
