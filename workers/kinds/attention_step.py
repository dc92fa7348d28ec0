"""An attention group's step: the serving backend's metadata (``kernels.attention.metadata``)
over the group's block table, and the backend as its kernels."""

from __future__ import annotations

from kernels.attention.graph_metadata import StaticDecodeMetadata
from workers.group_step import GraphStepInputs, GroupContext, GroupStep, GroupStepBuilder, StepBatch


class AttentionStep(GroupStepBuilder):
    def build(self, batch: StepBatch, block_rows) -> GroupStep:
        group = self.group
        metadata = group.backend.build_metadata(
            batch.query_lens, batch.seq_lens, block_rows, group.spec.block_size, group.device
        )
        return GroupStep(metadata, group.backend)

    def graph_inputs(self, max_batch: int, max_blocks: int) -> GraphStepInputs | None:
        if not self.group.backend.supports_cuda_graphs:
            return None
        return AttentionGraphInputs(self.group, max_batch, max_blocks)


class AttentionGraphInputs(GraphStepInputs):
    def __init__(self, group: GroupContext, max_batch: int, max_blocks: int):
        self.group = group
        block_size = group.spec.block_size
        self.static = StaticDecodeMetadata(max_batch, max_blocks, block_size, group.device)
        self.max_seq_len = max_blocks * block_size

    def step(self, batch_size: int) -> GroupStep:
        return GroupStep(self.static.metadata(batch_size, self.max_seq_len), self.group.backend)

    def load(self, batch: StepBatch, block_rows, batch_size: int) -> None:
        self.static.load(batch.seq_lens, block_rows, batch_size)
