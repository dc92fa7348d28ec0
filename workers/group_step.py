"""What a KV-cache group's step builder is given and gives back, for every kind of cache layer
(``workers.kinds``): the runner builds one per group, asks it for the group's metadata and
kernels each step, and hands them to the group's layers through the forward context. The
runner, the forward context and the profile know only these types, never a kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels.attention import AttentionBackend
from kvcore import KVCacheSpec
from workers.model_config import ModelConfig
from workers.options import RankSettings


@dataclass(frozen=True)
class StepLimits:
    """The largest step the engine runs: what the memory profile measures, and so the most
    scratch a step's metadata may ask of its kernels."""

    max_num_batched_tokens: int = RankSettings.default("max_num_batched_tokens")
    max_num_seqs: int = RankSettings.default("max_num_seqs")


@dataclass(frozen=True)
class StepBatch:
    """One step's requests, in batch order: their new tokens, flattened."""

    request_ids: list[str]
    query_lens: list[int]  # tokens computed for each in this step
    seq_lens: list[int]  # tokens each holds once they are
    num_prompt_tokens: list[int]  # each one's prompt length
    token_ids: list[int]
    positions: list[int]
    # Drafts among each one's tokens (its last ones; speculative decoding), empty: none.
    num_drafts: list[int] = field(default_factory=list)

    @property
    def num_computed(self) -> list[int]:
        """Tokens each request had computed before this step."""
        return [s - q for s, q in zip(self.seq_lens, self.query_lens, strict=True)]


@dataclass(frozen=True)
class GroupContext:
    """What a group's builder may read, once, when the runner starts."""

    index: int  # the group's place in the plan
    spec: KVCacheSpec  # its layers' spec (every layer of a group is of one kind)
    layers: list[nn.Module]  # its cache layers
    model_config: ModelConfig
    backend: AttentionBackend  # the serving attention backend; its name picks a kind's kernels
    device: torch.device
    limits: StepLimits


@dataclass(frozen=True)
class GroupStep:
    """A group's part of one step: the metadata its layers read and the kernels they call."""

    metadata: Any
    kernels: Any


class GraphStepInputs(ABC):
    """A group's part of the decode steps replayed from CUDA graphs (``workers.cuda_graphs``):
    static device buffers its metadata views, written before each replay."""

    @abstractmethod
    def step(self, batch_size: int) -> GroupStep:
        """The step a graph of ``batch_size`` decode rows is captured with (and replays)."""

    @abstractmethod
    def load(self, batch: StepBatch, block_rows: torch.Tensor, batch_size: int) -> None:
        """Write a decode step of at most ``batch_size`` requests into the buffers, the rows
        past it padding."""


class GroupStepBuilder(ABC):
    def __init__(self, group: GroupContext):
        self.group = group

    def graph_inputs(self, max_batch: int, max_blocks: int) -> GraphStepInputs | None:
        """Static inputs for decode graphs of up to ``max_batch`` requests of up to
        ``max_blocks`` blocks; None where this kind's steps cannot be captured (then the
        engine decodes eagerly)."""
        return None

    @abstractmethod
    def build(self, batch: StepBatch, block_rows: torch.Tensor) -> GroupStep:
        """The group's step: ``block_rows`` is its ``[R, W]`` int32 host table of manager
        block ids, one row per request of ``batch``."""

    def add_request(self, request_id: str, draft_block_ids: list[int]) -> None:  # noqa: B027
        """A request arrived (or resumed), with the draft-state blocks it holds in this
        group beside its table (``NewRequest.draft_block_ids``; most kinds hold none)."""

    def remove_request(self, request_id: str) -> None:  # noqa: B027
        """A request finished or was preempted."""

    def before_forward(self) -> None:  # noqa: B027 (most kinds have nothing to do)
        """Work the step needs done before the model runs (in its forward context)."""

    def after_sampling(self, num_accepted: dict[str, int]) -> None:  # noqa: B027
        """Work once the step's drafts are verified: ``num_accepted`` holds, for each request
        that carried drafts, how many were kept (a kind whose state took every draft in
        undoes the rest here; the scheduler rolls back the computed-token count)."""
