"""The tensor-parallel group of one worker process, and its links to the pipeline stages
next to it.

Collectives go through torch.distributed: NCCL on CUDA, gloo on CPU. CPU ranks that share a
host sum, broadcast and gather through a shared memory region instead
(``kernels.collectives.shm``; gloo's loopback TCP cost a decode step a millisecond per
collective on two cores), with gloo for what the region does not take. The rendezvous address
and port are chosen at run time by rank 0's host (``pick_rendezvous``), never hard-coded, so
two engines on one host cannot collide. A process that never joins a group acts as TP=1.

Without pipeline stages the TP group is torch's default group. With them every rank of every
stage joins one default group (``init_stage_groups``), each stage's ranks make a subgroup for
their collectives, and a stage's hidden states go point to point from its TP rank 0 to every
rank of the next stage (``send_to_next_stage``, ``recv_from_previous_stage``), so they never
pass through the controller.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.collectives import shm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    # MoE layers: each rank holds whole experts (True) or a slice of every expert (False).
    expert_parallel: bool = False
    # The stage's subgroup (None: the default group, which is the TP group without stages)
    # and the global rank of its TP rank 0, which broadcasts.
    group: object = None
    first_global_rank: int = 0

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class StageLinks:
    previous: int | None = None  # the global rank of the previous stage's TP rank 0
    following: tuple[int, ...] = ()  # the global ranks of the next stage


_group = TPGroup()
_links = StageLinks()
_sends: list = []  # (work, tensor) of the hidden states sent last, kept until received
_shm: shm.ShmCollectives | None = None  # the TP group's region, where every rank maps it


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
        if backend == "gloo":
            _open_shared_memory(rank, world_size)
    _group = TPGroup(rank=rank, world_size=world_size, expert_parallel=expert_parallel)
    return _group


def _host_identity() -> str:
    """Equal on two processes exactly when they share a kernel, so its /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}"


def _open_shared_memory(rank: int, world_size: int) -> None:
    """Map one region on every rank when all share a host; otherwise (or when any rank
    cannot) gloo serves every collective. Rank 0 makes the file and removes it once all
    have mapped it, so nothing outlives the processes."""
    global _shm
    directory = shm.shm_directory() if shm.library() is not None else None
    path = None
    if rank == 0 and directory is not None:
        path = os.path.join(directory, f"kvray-tp-{uuid.uuid4().hex}")
        try:
            shm.create_region(path, world_size)
        except OSError as exc:
            logger.warning("No shared memory for the TP group (%s); gloo serves it", exc)
            path = None
    offer = [path, _host_identity()]
    dist.broadcast_object_list(offer, src=0)
    mapped = None
    if offer[0] is not None and offer[1] == _host_identity():
        try:
            mapped = shm.ShmCollectives(offer[0], rank, world_size)
        except OSError as exc:
            logger.warning("Rank %d cannot map the TP group's shared memory (%s)", rank, exc)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mapped is not None)
    if rank == 0 and path is not None:
        os.unlink(path)
    if all(everyone):
        _shm = mapped
    elif mapped is not None:
        mapped.close()


def init_stage_groups(
    tp_rank: int,
    tp_size: int,
    stage: int,
    num_stages: int,
    init_method: str,
    *,
    backend: str,
    expert_parallel: bool = False,
) -> TPGroup:
    """Join every stage's ranks in one default group (global rank: stage x TP + TP rank),
    with a subgroup per stage for its collectives (every rank makes every subgroup, in the
    same order, as torch asks), and learn the ranks of the stages either side."""
    global _group, _links
    dist.init_process_group(
        backend, init_method=init_method, rank=stage * tp_size + tp_rank,
        world_size=tp_size * num_stages,
    )  # fmt: skip
    groups = [
        dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) if tp_size > 1 else None
        for s in range(num_stages)
    ]
    _group = TPGroup(
        rank=tp_rank, world_size=tp_size, expert_parallel=expert_parallel,
        group=groups[stage], first_global_rank=stage * tp_size,
    )  # fmt: skip
    following = range((stage + 1) * tp_size, (stage + 2) * tp_size)
    _links = StageLinks(
        previous=(stage - 1) * tp_size if stage > 0 else None,
        following=tuple(following) if stage + 1 < num_stages else (),
    )
    return _group


def destroy_tp_group() -> None:
    global _group, _links
    if dist.is_initialized():
        dist.destroy_process_group()
    _group, _links = TPGroup(), StageLinks()
    _sends.clear()
    _close_shared_memory()


def _close_shared_memory() -> None:
    global _shm
    if _shm is not None:
        _shm.close()
        _shm = None


def send_to_next_stage(hidden: torch.Tensor) -> None:
    """Send ``hidden`` to every rank of the next stage without waiting for them to take it
    (they may still run the step before); the sends before are waited for first."""
    for work, _ in _sends:
        work.wait()
    _sends.clear()
    hidden = hidden.contiguous()
    _sends.extend((dist.isend(hidden, dst), hidden) for dst in _links.following)


def recv_from_previous_stage(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The hidden states the previous stage's TP rank 0 sends for this step."""
    if _links.previous is None:
        raise RuntimeError("the first pipeline stage has no stage before it")
    hidden = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(hidden, src=_links.previous)
    return hidden


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place (a no-op at TP=1)."""
    if _group.world_size > 1:
        if _shm is not None and tensor.dtype == torch.float32 and _shm.serves(tensor):
            _shm.all_reduce(tensor)
        else:
            dist.all_reduce(tensor, group=_group.group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the last dimension, in rank order."""
    if _group.world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    if _shm is not None and _shm.serves(tensor) and _shm.fits(tensor):
        parts = _shm.all_gather(tensor)
    else:
        parts = [torch.empty_like(tensor) for _ in range(_group.world_size)]
        dist.all_gather(parts, tensor, group=_group.group)
    return torch.cat(parts, dim=-1)


def broadcast_from_first(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (sampled tokens, say)."""
    if _group.world_size > 1:
        if _shm is not None and _shm.serves(tensor) and _shm.fits(tensor):
            _shm.broadcast(tensor, root=0)
        else:
            dist.broadcast(tensor, src=_group.first_global_rank, group=_group.group)
    return tensor
