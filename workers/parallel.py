"""The tensor-parallel group of one worker process.

Collectives go through torch.distributed: NCCL on CUDA, gloo on CPU. The rendezvous address
and port are chosen at run time by rank 0's host (``pick_rendezvous``), never hard-coded, so
two engines on one host cannot collide. A process that never joins a group acts as TP=1.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    # MoE layers: each rank holds whole experts (True) or a slice of every expert (False).
    expert_parallel: bool = False

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


_group = TPGroup()


def get_tp_group() -> TPGroup:
    return _group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (for a server that takes no port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pick_rendezvous(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` address with a port that is free right now on ``host``."""
    return f"tcp://{host}:{free_port(host)}"


def init_tp_group(
    rank: int,
    world_size: int,
    init_method: str | None,
    *,
    backend: str,
    expert_parallel: bool = False,
):
    """Join the TP group over ``backend`` ("nccl" between GPUs, "gloo" between CPUs)."""
    global _group
    if world_size > 1:
        if init_method is None:
            raise ValueError("A tensor-parallel group of more than one rank needs an init_method")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _group = TPGroup(rank=rank, world_size=world_size, expert_parallel=expert_parallel)
    return _group


def destroy_tp_group() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place (a no-op at TP=1)."""
    if _group.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the last dimension, in rank order."""
    if _group.world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(_group.world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_from_first(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (sampled tokens, say)."""
    if _group.world_size > 1:
        dist.broadcast(tensor, src=0)
    return tensor
