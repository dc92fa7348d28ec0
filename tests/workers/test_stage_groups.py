"""The process groups of pipeline stages, over real gloo in four processes (PP 2 x TP 2):
each stage's collectives stay inside the stage, its TP rank 0 broadcasts, and hidden states
sent point to point reach every rank of the next stage whole and in the order sent."""

from __future__ import annotations

import torch

from tests.workers.engine import run_in_processes
from workers.parallel import (
    all_reduce,
    broadcast_from_first,
    destroy_tp_group,
    init_stage_groups,
    recv_from_previous_stage,
    send_to_next_stage,
)

TP, STAGES = 2, 2


def _rank_main(global_rank: int, address: str):
    stage, tp_rank = divmod(global_rank, TP)
    init_stage_groups(tp_rank, TP, stage, STAGES, address, backend="gloo")
    summed = all_reduce(torch.tensor([float(global_rank)])).item()
    first = broadcast_from_first(torch.tensor([global_rank])).item()
    received = []
    if stage == 0 and tp_rank == 0:
        for step in range(2):  # two steps' hidden states, the second sent at once
            send_to_next_stage(torch.full((3, 4), float(step)))
        send_to_next_stage(torch.zeros(1, 4))  # waits for the two before to be taken
    elif stage == 1:
        cpu = torch.device("cpu")
        for _ in range(2):
            received.append(recv_from_previous_stage((3, 4), torch.float32, cpu)[0, 0].item())
        recv_from_previous_stage((1, 4), torch.float32, cpu)
    destroy_tp_group()
    return summed, first, received


def test_stage_subgroups_and_point_to_point_hidden_states():
    results = run_in_processes(_rank_main, TP * STAGES, timeout=120)
    # Sums and broadcasts within each stage only: stage 0 holds ranks 0 and 1, stage 1 2 and 3.
    assert [results[r][:2] for r in range(4)] == [(1.0, 0), (1.0, 0), (5.0, 2), (5.0, 2)]
    assert results[2][2] == results[3][2] == [0.0, 1.0]  # both steps, in order
