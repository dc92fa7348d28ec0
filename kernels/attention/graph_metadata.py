"""Attention metadata for decode steps replayed from CUDA graphs.

A captured graph replays the kernel launches it recorded, with the arguments they had: the
same tensors (device pointers) and the same Python scalars. So a decode graph is captured
over metadata whose tensors are views of static buffers, and each step writes its values into
those buffers before the replay; everything the kernels take as a Python value (the row
count, the query tiles, the block table's row stride) is fixed by the graph's batch size.

A graph of ``B`` rows runs a step of ``n <= B`` decode requests: rows past ``n`` are padding,
each one query token over a context of one token in the null block (block 0) whose new key is
never written (slot -1). Their outputs are computed and thrown away.
"""

from __future__ import annotations

import torch

from kernels.attention.metadata import AttentionMetadata


class StaticDecodeMetadata:
    """Device buffers for decode steps of up to ``max_batch`` requests, one token each, and
    the pinned host copies each step's values travel through (one copy per buffer)."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device):
        self.max_batch = max_batch
        self.block_size = block_size
        # One token per request: the prefix sums are 0, 1, 2, ... and never change.
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host_seq_lens = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self._host_slots = torch.full((max_batch,), -1, dtype=torch.int64, pin_memory=pin)
        self._host_table = torch.zeros((max_batch, max_blocks), dtype=torch.int32, pin_memory=pin)

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """What a graph of ``batch_size`` rows is captured with: views of the buffers, and
        host values that hold for every step it replays (``max_seq_len``: the most any
        request reaches; the kernels read the real lengths from ``seq_lens``)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_table=self.block_table[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=tuple(range(batch_size + 1)),
            seq_lens_cpu=(1,) * batch_size,  # never read by a graph-capable backend
        )

    def load(self, seq_lens: list[int], block_rows: torch.Tensor, batch_size: int) -> None:
        """Write one decode step of ``len(seq_lens)`` requests (``block_rows``: their
        ``[n, w]`` host table) into the first ``batch_size`` rows, padding the rest."""
        num_reqs, width = block_rows.shape
        if num_reqs != len(seq_lens) or num_reqs > batch_size or batch_size > self.max_batch:
            raise ValueError(
                f"a decode step of {len(seq_lens)} requests ({num_reqs} table rows) does not "
                f"fit a graph of {batch_size} rows (at most {self.max_batch})"
            )
        if width > self.block_table.shape[1]:
            raise ValueError(f"{width} blocks per request exceed {self.block_table.shape[1]}")
        host_lens, host_slots = self._host_seq_lens.numpy(), self._host_slots.numpy()
        cells = block_rows.numpy()
        for row, seq_len in enumerate(seq_lens):
            position = seq_len - 1  # the one new token
            block = cells[row, position // self.block_size]
            host_lens[row] = seq_len
            host_slots[row] = int(block) * self.block_size + position % self.block_size
        host_lens[num_reqs:batch_size] = 1
        host_slots[num_reqs:batch_size] = -1
        self._host_table[:num_reqs, :width] = block_rows
        # Whole rows, contiguous on both sides, so the copy stays asynchronous. A row's cells
        # past its blocks, and the padding rows, keep ids of earlier steps: every id is a
        # real block, and the kernels read only the blocks a row's length covers.
        self.seq_lens[:batch_size].copy_(self._host_seq_lens[:batch_size], non_blocking=True)
        self.slot_mapping[:batch_size].copy_(self._host_slots[:batch_size], non_blocking=True)
        self.block_table[:num_reqs].copy_(self._host_table[:num_reqs], non_blocking=True)
