"""Per-step attention metadata: built once from plain per-request lists, read by every layer.

A step's batch is a list of requests, each with ``query_len`` new tokens (a prefill chunk, or 1
for decode) and ``seq_len`` tokens in total once they are written. The new tokens of request i
sit at absolute positions ``seq_len - query_len .. seq_len - 1`` and are packed back to back in
the step's query tensor, starting at ``query_start_loc[i]``. Token p of a request lives in
manager block ``block_table[i, p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``, which is also its slot in a kernel-block split view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.host import HOST

# Steps of up to this many tokens compute their slots in a Python loop, longer ones in torch.
LOOP_MAX_TOKENS = 128


@dataclass(frozen=True)
class AttentionMetadata:
    """Device tensors for the kernels plus host copies for the torch path (no device syncs)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of query_lens
    seq_lens: torch.Tensor  # [num_reqs] int32, tokens per request after this step
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int32 manager block ids, 0-padded
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens
    block_size: int  # tokens per manager block
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_actual_tokens(self) -> int:
        """Tokens that belong to a request; the query tensor may be padded past them."""
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len <= 1


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]] | torch.Tensor,
    block_size: int,
    device: torch.device | str = "cpu",
    num_tokens: int | None = None,
) -> AttentionMetadata:
    """Metadata for one step. ``block_tables`` is one list of block ids per request, or a
    ready ``[num_reqs, width]`` int32 host tensor (the worker keeps its tables as rows of one,
    updated by delta). ``num_tokens`` pads the slot mapping with -1 (skipped writes)."""
    _check_batch(query_lens, seq_lens, block_tables, block_size)
    num_actual = sum(query_lens)
    num_tokens = num_actual if num_tokens is None else num_tokens
    if num_tokens < num_actual:
        raise ValueError(f"num_tokens={num_tokens} is less than the {num_actual} query tokens.")
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    is_ready = isinstance(block_tables, torch.Tensor)
    table = block_tables if is_ready else _block_table(block_tables)
    slot_of = _slots_by_loop if num_actual <= LOOP_MAX_TOKENS else _slots_by_tensors
    slots = slot_of(query_lens, seq_lens, starts, table, block_size, num_tokens)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=slots.to(device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(seq_lens),
    )


def _slots_by_loop(query_lens, seq_lens, starts, table, block_size, num_tokens) -> torch.Tensor:
    """The slot mapping of a step of a few tokens (decode steps), in plain Python: each torch
    op costs a few microseconds, and ten times that right after a forward has streamed the
    weights through the caches, more than a loop over a few dozen tokens."""
    slots = []
    for row, query_len, seq_len in zip(table.tolist(), query_lens, seq_lens, strict=True):
        for position in range(seq_len - query_len, seq_len):
            slots.append(row[position // block_size] * block_size + position % block_size)
    slots += [-1] * (num_tokens - len(slots))
    return torch.tensor(slots, dtype=torch.int64, device=HOST)


def _slots_by_tensors(query_lens, seq_lens, starts, table, block_size, num_tokens) -> torch.Tensor:
    """The slot mapping of a step of many tokens (prefill chunks): one vectorised pass over
    every token, on the host (the lists live there)."""
    num_actual = starts[-1]
    query_len_t = torch.tensor(list(query_lens), dtype=torch.int64, device=HOST)
    request_of = torch.repeat_interleave(
        torch.arange(len(query_lens), device=HOST), query_len_t
    )  # [T]
    first_position = torch.tensor(list(seq_lens), dtype=torch.int64, device=HOST) - query_len_t
    starts_t = torch.tensor(starts[:-1], dtype=torch.int64, device=HOST)
    offsets = torch.arange(num_actual, device=HOST) - starts_t[request_of]
    positions = first_position[request_of] + offsets
    blocks = table[request_of, positions // block_size].to(torch.int64)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=HOST)
    slots[:num_actual] = blocks * block_size + positions % block_size
    return slots


def _block_table(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[num_reqs, max_num_blocks]`` int32, rows padded with 0 (the null block)."""
    lengths = torch.tensor([len(row) for row in block_tables], dtype=torch.int64, device=HOST)
    width = max(int(lengths.max()) if len(block_tables) else 0, 1)
    table = torch.zeros((len(block_tables), width), dtype=torch.int32, device=HOST)
    filled = torch.arange(width, device=HOST)[None, :] < lengths[:, None]  # row-major, like ids
    flat = [b for row in block_tables for b in row]
    table[filled] = torch.tensor(flat, dtype=torch.int32, device=HOST)
    return table


def _check_batch(query_lens, seq_lens, block_tables, block_size) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    if not len(query_lens) == len(seq_lens) == len(block_tables):  # tensors: their rows
        raise ValueError(
            f"query_lens, seq_lens and block_tables must have one entry per request; got "
            f"{len(query_lens)}, {len(seq_lens)} and {len(block_tables)}."
        )
    widths = (
        [block_tables.shape[1]] * len(seq_lens)
        if isinstance(block_tables, torch.Tensor)
        else [len(row) for row in block_tables]
    )
    for i, (query_len, seq_len, width) in enumerate(zip(query_lens, seq_lens, widths, strict=True)):
        if not 0 <= query_len <= seq_len:
            raise ValueError(
                f"Request {i}: need 0 <= query_len <= seq_len, got {query_len} and {seq_len}."
            )
        needed = -(-seq_len // block_size)
        if width < needed:
            raise ValueError(
                f"Request {i}: {seq_len} tokens need {needed} blocks of {block_size}, but its "
                f"block table has {width}."
            )
