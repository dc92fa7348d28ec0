"""The TP group's shared-memory collectives (``kernels.collectives.shm`` behind
``workers.parallel``), between real processes on a real gloo group: the same bits as gloo,
longer sums in parts, the region file gone once mapped, and gloo for ranks that do not share a
host."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist

from kernels.collectives import shm
from tests.workers.engine import run_in_processes
from workers import parallel


def _collectives(rank: int, address: str, world: int) -> dict:
    parallel.init_tp_group(rank, world, address, backend="gloo")
    try:
        generator = torch.Generator().manual_seed(100 + rank)
        results = {"shared": parallel._shm is not None}
        # A decode step's activations, and a prefill's: longer than a slot, summed in parts.
        for name, shape in (("step", (16, 512)), ("prefill", (700, 576))):
            mine = torch.randn(shape, generator=generator)
            by_gloo = mine.clone()
            dist.all_reduce(by_gloo)
            # As lists: tensors do not cross the process boundary once it has exited.
            results[name] = (parallel.all_reduce(mine.clone()).tolist(), by_gloo.tolist())
        tokens = torch.arange(8) * (rank + 1)
        results["broadcast"] = parallel.broadcast_from_first(tokens).tolist()
        gathered = parallel.all_gather_last_dim(torch.full((2, 3), float(rank)))
        results["gathered"] = gathered.tolist()
        # Many calls in a row reuse the two slot sets: a rank running ahead must not
        # overwrite what a slower one still reads.
        total = torch.zeros(64)
        for i in range(200):
            total += parallel.all_reduce(torch.full((64,), float(rank + i)))
        results["repeated"] = total[0].item()
        results["files"] = [f for f in os.listdir("/dev/shm") if f.startswith("kvray-tp-")]
        return results
    finally:
        parallel.destroy_tp_group()


def _on_other_hosts(rank: int, address: str, world: int) -> dict:
    """Every rank says it is on a host of its own: no region, gloo for all."""
    parallel._host_identity = lambda: f"host-{rank}"
    return _collectives(rank, address, world)


def _without_room(rank: int, address: str, world: int) -> dict:
    """/dev/shm is full: rank 0 cannot reserve the region, and gloo serves every rank."""

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    shm.create_region = full
    return _collectives(rank, address, world)


def _check(results: dict, world: int) -> None:
    for rank, got in results.items():
        for name in ("step", "prefill"):
            summed, by_gloo = got[name]
            assert summed == by_gloo, f"rank {rank}: {name} differs from gloo's"
        assert results[rank]["step"][0] == results[0]["step"][0]
        assert got["broadcast"] == list(range(8))
        assert got["gathered"] == [[float(r) for r in range(world) for _ in range(3)]] * 2
        expected = sum(sum(float(r + i) for r in range(world)) for i in range(200))
        assert got["repeated"] == expected


def test_ranks_of_one_host_share_memory_and_match_gloo():
    results = run_in_processes(_collectives, 2, 2, timeout=300)
    assert all(got["shared"] for got in results.values())
    _check(results, 2)
    # Rank 0 removes the file once every rank has mapped it (tests run one at a time).
    assert all(got["files"] == [] for got in results.values())


def test_three_ranks_sum_in_rank_order_like_each_other():
    results = run_in_processes(_collectives, 3, 3, timeout=300)
    assert all(got["shared"] for got in results.values())
    for rank in (1, 2):  # every rank holds the same bits (gloo's may differ in the last)
        assert results[rank]["prefill"][0] == results[0]["prefill"][0]
    for got in results.values():
        summed, by_gloo = got["prefill"]
        torch.testing.assert_close(torch.tensor(summed), torch.tensor(by_gloo))
        assert got["broadcast"] == list(range(8))


@pytest.mark.parametrize("target", [_on_other_hosts, _without_room])
def test_ranks_that_cannot_share_keep_gloo(target):
    results = run_in_processes(target, 2, 2, timeout=300)
    assert not any(got["shared"] for got in results.values())
    _check(results, 2)
