"""Per-step metadata of an MLA (DeepSeek) cache group: which queries attend in latent space
and which prefills expand their context into per-head K/V. Built once per step, read by every
MLA layer.

The two ways one query can attend over the latent cache:

- **Latent** (absorbed weights): the nope query is projected into latent space and attends the
  cached latents directly. It reads ``kv_lora_rank + qk_rope_head_dim`` values per cached token
  and head, and needs no memory beyond the query. Every decode token takes it; so does every
  token of a prefill that does not expand, each token a row of the decode kernel that sees
  its own position and the ones before (its causal mask is its length). The kernel's split
  workspace grows with its rows, so the layer runs at most ``max_rows_per_call`` rows at a
  time: the most decode rows a step can have (``max_num_seqs``), which the memory profile's
  decode rows measured (to within one: the profile's longest request is among them).
- **Expanded**: the request's whole context is projected up to per-head keys
  ``[k_nope (P) | k_pe (R)]`` and values (V), and the attention backend's paged prefill runs
  over them. Each query then does less per context token and head (``P + R + V`` against
  ``2 L + R`` multiply-adds), but the expansion costs ``L (P + V)`` per context token and
  head whatever the query count, and takes ``context × heads × (P + R + V)`` elements of
  scratch.

So a prefill expands when its new tokens are enough to repay the expansion
(``expansion_threshold``: 55 for DeepSeek-V3's geometry) and its context fits what is left of
the step's ``expand_budget`` (the largest step's token count, so the scratch never outgrows
what the memory profile measured). ``python -m cluster.bench.mla_prefill`` measures both
ways: on CPUs (16 heads of DeepSeek-V3, fp32) expanding was about 2x faster for whole prompts
of 128-1024 tokens and 1.4x for 128 new tokens over 2048, and 2-7x slower for 8-32 new
tokens over 2-4K, which the threshold reproduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend
from kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from kernels.host import HOST
from kernels.mla import MLABackend, get_mla_backend
from workers.group_step import GraphStepInputs, GroupContext, GroupStep, GroupStepBuilder, StepBatch
from workers.kinds.attention_step import AttentionGraphInputs
from workers.model_config import MLAConfig


@dataclass(frozen=True)
class LatentQueries:
    """Step tokens attended in latent space, one decode-kernel row each."""

    token_index: torch.Tensor | None  # [n] int64 rows of the step's tokens; None: all of them
    block_table: torch.Tensor  # [n, W] int32 manager block ids (the token's request's row)
    seq_lens: torch.Tensor  # [n] int32 cached tokens each row sees: its position + 1
    max_rows_per_call: int  # the most rows one decode-kernel call takes


@dataclass(frozen=True)
class ExpandedPrefills:
    """Prefill requests whose context is expanded to per-head K/V for the attention backend."""

    token_index: torch.Tensor | None  # [m] int64 rows of the step's tokens; None: all of them
    context_slots: torch.Tensor  # [S] int64 cache slots of every context token, request by request
    # The attention backend's metadata over the expanded K/V: blocks of one token, request j's
    # context at rows ``offset_j .. offset_j + seq_len_j - 1`` of the expansion.
    metadata: AttentionMetadata


@dataclass(frozen=True)
class MLAMetadata:
    attention: AttentionMetadata  # the group's own: the slot mapping writes the new latents
    latent: LatentQueries | None
    expanded: ExpandedPrefills | None


def build_mla_metadata(
    attention: AttentionMetadata,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_rows: torch.Tensor,
    device: torch.device | str,
    expand_budget: int,
    min_expanded_query_len: int = 2,
    max_latent_rows_per_call: int | None = None,
) -> MLAMetadata:
    """Split the step's requests between the two paths. ``block_rows`` is the group's
    ``[R, W]`` int32 host table of manager block ids, as ``attention`` was built from."""
    expanded = select_expanded(query_lens, seq_lens, expand_budget, min_expanded_query_len)
    num_tokens = sum(query_lens)
    lens = torch.tensor(list(query_lens), dtype=torch.int64, device=HOST)
    request_of = torch.repeat_interleave(torch.arange(len(query_lens), device=HOST), lens)
    is_expanded = torch.zeros(len(query_lens), dtype=torch.bool, device=HOST)
    is_expanded[expanded] = True
    token_is_expanded = is_expanded[request_of]
    num_expanded_tokens = int(token_is_expanded.sum())
    latent = None
    if num_expanded_tokens < num_tokens:
        max_rows = max_latent_rows_per_call or num_tokens
        latent = _latent_queries(
            query_lens, seq_lens, block_rows, request_of, ~token_is_expanded, device, max_rows
        )
    prefills = None
    if expanded:
        prefills = _expanded_prefills(
            query_lens,
            seq_lens,
            block_rows,
            attention.block_size,
            expanded,
            token_is_expanded,
            device,
        )
    return MLAMetadata(attention=attention, latent=latent, expanded=prefills)


# What one multiply-add in latent space costs in expanded ones: the latent path reads the
# cache once per query row, the expansion is one matmul. Measured with
# ``python -m cluster.bench.mla_prefill`` on CPUs; a GPU run of it would retune it there.
LATENT_COST_RATIO = 2.5


def expansion_threshold(mla: MLAConfig) -> int:
    """The fewest new tokens for which expanding a request's context is cheaper than
    attending in latent space. Per context token and head, expanding costs ``L (P + V)``
    once, then ``P + R + V`` per query; the latent path ``2 L + R`` per query, each at
    ``LATENT_COST_RATIO``. 2 (any prefill) when a latent query is never dearer."""
    latent, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
    nope, value = mla.qk_nope_head_dim, mla.v_head_dim
    saving_per_query = LATENT_COST_RATIO * (2 * latent + rope) - (nope + rope + value)
    if saving_per_query <= 0:
        return 2
    return max(2, int(latent * (nope + value) / saving_per_query) + 1)


def select_expanded(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    expand_budget: int,
    min_query_len: int = 2,
) -> list[int]:
    """The requests with at least ``min_query_len`` (and more than one) new tokens to expand,
    in batch order, while their contexts add up to at most ``expand_budget`` tokens."""
    chosen, left = [], expand_budget
    min_query_len = max(min_query_len, 2)
    for index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if query_len >= min_query_len and seq_len <= left:
            chosen.append(index)
            left -= seq_len
    return chosen


def _token_index(mask: torch.Tensor, device) -> torch.Tensor | None:
    if bool(mask.all()):
        return None  # every token: the layer skips the gather and the scatter
    return mask.nonzero().flatten().to(device)


def _latent_queries(
    query_lens, seq_lens, block_rows, request_of, mask, device, max_rows_per_call
) -> LatentQueries:
    """Each selected token is a row seeing the positions up to its own."""
    starts = torch.tensor([0, *query_lens], dtype=torch.int64, device=HOST).cumsum(0)
    seq_len_t = torch.tensor(list(seq_lens), dtype=torch.int64, device=HOST)
    query_len_t = torch.tensor(list(query_lens), dtype=torch.int64, device=HOST)
    offset_in_query = torch.arange(len(request_of), device=HOST) - starts[request_of]
    # The token at offset t of a request with q new tokens sits at position s - q + t.
    visible = (seq_len_t - query_len_t)[request_of] + offset_in_query + 1
    requests = request_of[mask]
    return LatentQueries(
        token_index=_token_index(mask, device),
        block_table=block_rows.index_select(0, requests).to(device),
        seq_lens=visible[mask].to(torch.int32).to(device),
        max_rows_per_call=max_rows_per_call,
    )


def _expanded_prefills(
    query_lens, seq_lens, block_rows, block_size, expanded, token_is_expanded, device
) -> ExpandedPrefills:
    chosen = torch.tensor(expanded, dtype=torch.int64, device=HOST)
    context_lens = torch.tensor([seq_lens[i] for i in expanded], dtype=torch.int64, device=HOST)
    # Every context position of every chosen request, and its cache slot.
    request_of = torch.repeat_interleave(chosen, context_lens)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=HOST), context_lens.cumsum(0)])
    owner = torch.repeat_interleave(torch.arange(len(expanded), device=HOST), context_lens)
    positions = torch.arange(int(context_lens.sum()), device=HOST) - offsets[owner]
    blocks = block_rows[request_of, positions // block_size].to(torch.int64)
    slots = blocks * block_size + positions % block_size
    # Request j's expansion is rows offset_j.. of one flat buffer: with blocks of one token,
    # its block table is that run of row numbers.
    width = int(context_lens.max())
    table = (offsets[:-1, None] + torch.arange(width, device=HOST)[None, :]).to(torch.int32)
    metadata = build_attention_metadata(
        [query_lens[i] for i in expanded],
        [seq_lens[i] for i in expanded],
        table,
        1,
        device,
    )
    return ExpandedPrefills(
        token_index=_token_index(token_is_expanded, device),
        context_slots=slots.to(device),
        metadata=metadata,
    )


@dataclass(frozen=True)
class MLAKernels:
    """An MLA layer's kernels: the latent cache's (write, absorbed decode) and the attention
    backend's paged prefill, which the expanded prefills run."""

    latent: MLABackend
    attention: AttentionBackend


class MLAStep(GroupStepBuilder):
    """An MLA group's step: its requests split between the latent and expanded paths within
    the largest step's limits (what the memory profile ran)."""

    def __init__(self, group: GroupContext):
        super().__init__(group)
        self.kernels = MLAKernels(get_mla_backend(group.backend.name), group.backend)
        self.min_expanded_query_len = expansion_threshold(group.model_config.mla)

    def build(self, batch: StepBatch, block_rows: torch.Tensor) -> GroupStep:
        group = self.group
        lens = (batch.query_lens, batch.seq_lens)
        attention = group.backend.build_metadata(
            *lens, block_rows, group.spec.block_size, group.device
        )
        metadata = build_mla_metadata(
            attention,
            *lens,
            block_rows,
            group.device,
            group.limits.max_num_batched_tokens,
            self.min_expanded_query_len,
            group.limits.max_num_seqs,
        )
        return GroupStep(metadata, self.kernels)

    def graph_inputs(self, max_batch: int, max_blocks: int) -> GraphStepInputs | None:
        if not self.group.backend.supports_cuda_graphs:
            return None
        return MLAGraphInputs(self.group, max_batch, max_blocks, self.kernels)


class MLAGraphInputs(AttentionGraphInputs):
    """Decode rows all attend in latent space, each over its whole context: the latent rows
    are the group's own block table and lengths."""

    def __init__(self, group: GroupContext, max_batch: int, max_blocks: int, kernels: MLAKernels):
        super().__init__(group, max_batch, max_blocks)
        self.kernels = kernels

    def step(self, batch_size: int) -> GroupStep:
        attention = self.static.metadata(batch_size, self.max_seq_len)
        latent = LatentQueries(
            token_index=None,
            block_table=attention.block_table,
            seq_lens=attention.seq_lens,
            max_rows_per_call=max(batch_size, self.group.limits.max_num_seqs),
        )
        return GroupStep(MLAMetadata(attention, latent, expanded=None), self.kernels)
