"""An attention group's step: the serving backend's metadata (``kernels.attention.metadata``)
over the group's block table, and the backend as its kernels."""

from __future__ import annotations

from workers.group_step import GroupStep, GroupStepBuilder, StepBatch


class AttentionStep(GroupStepBuilder):
    def build(self, batch: StepBatch, block_rows) -> GroupStep:
        group = self.group
        metadata = group.backend.build_metadata(
            batch.query_lens, batch.seq_lens, block_rows, group.spec.block_size, group.device
        )
        return GroupStep(metadata, group.backend)
