"""How a varlen SSD batch splits into chunks, shared by the torch reference and the Triton path.

Chunks are aligned to absolute positions: a request that starts at position p (tokens computed
before this step) has a first chunk of ``chunk_size - p % chunk_size`` tokens (or fewer), then
full chunks, then a remainder, so no chunk crosses a multiple of ``chunk_size`` and a state at
such a multiple is a chunk's final state. Chunks never cross requests. Building the table reads
two numbers back to the host (the chunk count and the count of misplaced checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SSDChunks:
    chunk_size: int
    chunk_request: torch.Tensor  # [NC] int32: the request each chunk belongs to
    chunk_start: torch.Tensor  # [NC] int32: the chunk's first token (row of x)
    chunk_len: torch.Tensor  # [NC] int32: its tokens, 1..chunk_size
    first_chunk: torch.Tensor  # [R] int32: each request's first chunk
    num_chunks: torch.Tensor  # [R] int32: its chunks (0 for a request with no tokens)
    checkpoint_chunk: torch.Tensor  # [M] int64: the chunk whose final state is checkpoint m
    checkpoint_slot: torch.Tensor  # [M] int64: where checkpoint m goes

    @property
    def num_chunks_total(self) -> int:
        return self.chunk_request.shape[0]

    def checkpoints_by_chunk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets ``[NC+1]``, slots ``[M]``), int32: chunk c's final state goes to slots
        ``offsets[c]:offsets[c+1]`` (a chunk may end several checkpoints, or none)."""
        order = torch.argsort(self.checkpoint_chunk, stable=True)
        counts = torch.bincount(self.checkpoint_chunk, minlength=self.num_chunks_total)
        offsets = torch.zeros(self.num_chunks_total + 1, dtype=torch.int32, device=counts.device)
        offsets[1:] = torch.cumsum(counts, 0)
        return offsets, self.checkpoint_slot[order].to(torch.int32)


def build_ssd_chunks(
    query_start_loc: torch.Tensor,
    chunk_size: int,
    start_positions: torch.Tensor | None = None,
    checkpoints: torch.Tensor | None = None,
) -> SSDChunks:
    """The chunk table of one prefill batch; refuses checkpoints that are not chunk ends."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}.")
    device = query_start_loc.device
    starts_loc = query_start_loc.to(torch.int64)
    query_lens = starts_loc[1:] - starts_loc[:-1]  # [R]
    if start_positions is None:
        start_positions = torch.zeros_like(query_lens)
    first_len = torch.minimum(query_lens, chunk_size - start_positions.to(torch.int64) % chunk_size)
    rest = (query_lens - first_len + chunk_size - 1) // chunk_size
    num_chunks = torch.where(query_lens > 0, 1 + rest, 0)  # [R]
    first_chunk = torch.cumsum(num_chunks, 0) - num_chunks

    if checkpoints is None:
        checkpoints = torch.zeros(0, 3, dtype=torch.int64, device=device)
    ckpt_req, ckpt_n, ckpt_slot = checkpoints.to(torch.int64).unbind(1)
    # Token n-1 is in chunk 0 when n <= first_len, else in chunk 1 + (n - first_len - 1) // Q.
    ckpt_first = first_len[ckpt_req]
    ckpt_k = torch.where(ckpt_n <= ckpt_first, 0, 1 + (ckpt_n - ckpt_first - 1) // chunk_size)
    ckpt_end = torch.minimum(ckpt_first + ckpt_k * chunk_size, query_lens[ckpt_req])
    is_misplaced = (ckpt_end != ckpt_n) | (ckpt_n < 1)
    num_total, num_misplaced = torch.stack([num_chunks.sum(), is_misplaced.sum()]).tolist()
    if num_misplaced:
        raise ValueError(
            f"{num_misplaced} checkpoint(s) do not end a chunk: each needs "
            f"(start_position + n) % {chunk_size} == 0 or n == the query length, and n >= 1."
        )

    chunk_request = torch.repeat_interleave(
        torch.arange(len(query_lens), device=device), num_chunks, output_size=num_total
    )  # [NC]
    k = torch.arange(num_total, device=device) - first_chunk[chunk_request]
    req_first_len = first_len[chunk_request]
    begin = torch.where(k == 0, 0, req_first_len + (k - 1) * chunk_size)
    end = torch.minimum(req_first_len + k * chunk_size, query_lens[chunk_request])
    as_int32 = dict(dtype=torch.int32)
    return SSDChunks(
        chunk_size=chunk_size,
        chunk_request=chunk_request.to(**as_int32),
        chunk_start=(starts_loc[chunk_request] + begin).to(**as_int32),
        chunk_len=(end - begin).to(**as_int32),
        first_chunk=first_chunk.to(**as_int32),
        num_chunks=num_chunks.to(**as_int32),
        checkpoint_chunk=first_chunk[ckpt_req] + ckpt_k,
        checkpoint_slot=ckpt_slot,
    )
