"""Per-step metadata of a Mamba KV-cache group: which requests decode and which prefill, where
their tokens sit in the step's batch, and which state slot each one reads and writes.

A request decodes (the one-token kernels) when it computes exactly one generated token; every
other request prefills (the varlen kernels), a lone prompt token included, because transformers
runs every prompt token through its chunked scan and floors dt there (``MambaConfig.dt_min``),
but not in its recurrent step. A prefill chunk that holds generated tokens (a preempted
request recomputing its outputs) is scanned in two passes, prompt part then the rest, so each
token gets the dt floor transformers gave it; the second pass starts from the first's state.

The state slot is a block id of the group's block table. With ``mamba_cache_mode="none"`` a
request holds one block for its life and that block is its slot (``state_slots``). With prefix
caching ("align" mode, ``plan_align_states``) table position i holds the state after
``(i + 1) * interval`` tokens: a step reads the state of its first token's position, copies it
into the block of its last token's position when that is another block (the copy runs on the
worker before the forward), and checkpoints every position boundary it crosses on the way
into that position's block, so each becomes a prefix-cache entry (``kvcore.managers.mamba``).

A request verifying k drafts (speculative decoding) holds k draft blocks (in mode "none" after
its slot in its row, in "align" mode beside its table): its tokens are scanned in a pass of
their own, one token a chunk, and the state after each token but the last is checkpointed
into them. Once the drafts are verified (``after_sampling``) a request that kept j < k of them
takes the state after its known token and those j (draft block j + 1) as its state: copied
into its slot, or in "align" mode into the block of the position that count ends in (the
step's copy source when the rejected drafts had crossed into a new position; a boundary state
checkpointed past that count is rewritten when the request crosses it again, and the prefix
cache only takes states up to the verified count). The scheduler's computed count falls back
with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.host import HOST
from kernels.mamba import VarlenBatch, get_mamba_backend
from kernels.mamba.chunks import build_ssd_chunks
from workers.group_step import GroupContext, GroupStep, GroupStepBuilder, StepBatch


@dataclass(frozen=True)
class MambaBatch(VarlenBatch):
    """Requests of one kind in a step, in batch order: the kernels' varlen batch (state slots,
    whether each reads one, query starts, start positions, checkpoints, the scan's chunk
    table, built once for every Mamba layer of the step), and where its tokens sit in the
    step."""

    token_index: torch.Tensor | None = None  # [T_b] int64 rows of the step's tokens; None: all
    is_prompt: bool = True  # (SSD passes) the tokens are prompt tokens: dt is floored


@dataclass(frozen=True)
class MambaMetadata:
    decode: MambaBatch | None  # one generated token per request
    prefill: MambaBatch | None  # whole chunks: the conv, and the scan when one pass suffices
    prefill_ssd_passes: tuple[MambaBatch, ...]  # the scan: prompt tokens, then generated ones
    chunk_size: int | None = None  # the scan's chunk (None in tests: the model's)


@dataclass(frozen=True)
class AlignPlan:
    """Where each request's state goes in one step of an "align"-mode group (batch order)."""

    slots: list[int]  # the block the step reads and writes: its last token's position
    copies: tuple[list[int], list[int]]  # (from, to) blocks, copied before the forward
    checkpoints: list[list[tuple[int, int]]]  # per request: (tokens consumed, block)


def state_slots(block_table: torch.Tensor) -> list[int]:
    """Each request's state slot from its row of the group's block table (``[R, width]``):
    in mode "none" the one block a request holds."""
    return block_table[:, 0].tolist()


def plan_align_states(
    rows: list[list[int]],
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    interval: int,
) -> AlignPlan:
    """Each request's slot, copy and checkpoints for a step, from its block-table row
    (``rows``, block ids by position; 0 is the null block) with ``interval`` tokens per
    position. A boundary crossed inside the step whose position holds no block (the manager
    caps checkpoints per step) is not saved."""
    plan = AlignPlan([], ([], []), [])
    for row, done, count in zip(rows, num_computed, query_lens, strict=True):
        end = done + count
        last = -(-end // interval) - 1
        slot = row[last]
        plan.slots.append(slot)
        if done > 0:
            source = row[-(-done // interval) - 1]
            if source != slot:
                plan.copies[0].append(source)
                plan.copies[1].append(slot)
        saved = []
        for position in range(done // interval, last):
            boundary = (position + 1) * interval
            if boundary > done and row[position]:
                saved.append((boundary - done, row[position]))
        plan.checkpoints.append(saved)
    return plan


@dataclass(frozen=True)
class _StepRequests:
    """A step's requests as ``build_mamba_metadata`` was given them, and where each one's
    tokens start in the step; makes the batch of any subset of them."""

    num_computed: Sequence[int]
    slots: Sequence[int]
    checkpoints: Sequence[Sequence[tuple[int, int]]] | None
    starts: list[int]  # [R + 1]: request i's tokens start at starts[i]
    device: torch.device | str
    chunk_size: int | None

    def batch(
        self, requests, spans, is_prompt: bool = True, scan: bool = True, chunk_size=None
    ) -> MambaBatch:
        """``spans``: each request's (first token, count) in the step; ``scan``: an SSD pass
        (its chunk table is built here, for every layer), in chunks of ``chunk_size`` (the
        step's when None)."""
        device, starts = self.device, self.starts
        chunk_size = chunk_size or self.chunk_size
        rows = [row for first, count in spans for row in range(first, first + count)]
        lens = [count for _, count in spans]
        positions = [
            self.num_computed[i] + first - starts[i]
            for i, (first, _) in zip(requests, spans, strict=True)
        ]
        query_start_loc = _tensor([0, *_cumsum(lens)], torch.int32, device)
        start_positions = _tensor(positions, torch.int32, device)
        saved = self._checkpoints_in(requests, spans)
        chunks = None
        if scan and chunk_size is not None:
            chunks = build_ssd_chunks(query_start_loc, chunk_size, start_positions, saved)
        return MambaBatch(
            # Disjoint, ascending spans that cover every token are the whole step, in order.
            token_index=None if len(rows) == starts[-1] else _tensor(rows, torch.int64, device),
            query_start_loc=query_start_loc,
            state_indices=_tensor([self.slots[i] for i in requests], torch.int32, device),
            has_initial_state=_tensor([p > 0 for p in positions], torch.bool, device),
            start_positions=start_positions,
            is_prompt=is_prompt,
            checkpoints=saved,
            chunk_size=chunk_size,
            chunks=chunks,
        )

    def _checkpoints_in(self, requests, spans) -> torch.Tensor | None:
        """The checkpoints inside each span, counted from the span's start."""
        saved = []
        for local, (i, (first, count)) in enumerate(zip(requests, spans, strict=True)):
            skip = first - self.starts[i]
            for consumed, slot in self.checkpoints[i] if self.checkpoints else ():
                if skip < consumed <= skip + count:
                    saved.append((local, consumed - skip, slot))
        return _tensor(saved, torch.int32, self.device) if saved else None


def build_mamba_metadata(
    query_lens: Sequence[int],
    num_computed: Sequence[int],
    num_prompt_tokens: Sequence[int],
    slots: Sequence[int],
    device: torch.device | str = "cpu",
    checkpoints: Sequence[Sequence[tuple[int, int]]] | None = None,
    chunk_size: int | None = None,
    num_drafts: Sequence[int] = (),
) -> MambaMetadata:
    """Metadata of one step; per request (batch order): new tokens, tokens computed before,
    prompt length, state slot, the states to checkpoint on the way as (tokens consumed,
    slot) pairs (only prefills cross a boundary before their last token), and the drafts
    among its tokens (none when empty). A request with drafts is scanned in a pass of its
    own, one token a chunk, so that a checkpoint can follow any of its tokens."""
    starts = [0, *_cumsum(query_lens)]
    step = _StepRequests(num_computed, slots, checkpoints, starts, device, chunk_size)
    is_decode = [
        n == 1 and done >= prompt
        for n, done, prompt in zip(query_lens, num_computed, num_prompt_tokens, strict=True)
    ]
    decodes = [i for i, flag in enumerate(is_decode) if flag]
    prefills = [i for i, flag in enumerate(is_decode) if not flag]
    decode = step.batch(decodes, [(starts[i], 1) for i in decodes], scan=False) if decodes else None
    if not prefills:
        return MambaMetadata(decode, None, (), chunk_size)
    prompt_counts = {
        i: min(max(num_prompt_tokens[i] - num_computed[i], 0), query_lens[i]) for i in prefills
    }
    one_pass = all(prompt_counts[i] == query_lens[i] for i in prefills)
    prefill = step.batch(prefills, [(starts[i], query_lens[i]) for i in prefills], scan=one_pass)
    if one_pass:
        return MambaMetadata(decode, prefill, (prefill,), chunk_size)
    passes = []
    in_prompt = [i for i in prefills if prompt_counts[i] > 0]
    if in_prompt:
        passes.append(step.batch(in_prompt, [(starts[i], prompt_counts[i]) for i in in_prompt]))
    drafted = {i for i in prefills if num_drafts and num_drafts[i]}
    for group, group_chunk in ((set(prefills) - drafted, None), (drafted, 1)):
        rest = [i for i in prefills if i in group and prompt_counts[i] < query_lens[i]]
        if not rest:
            continue
        spans = [(starts[i] + prompt_counts[i], query_lens[i] - prompt_counts[i]) for i in rest]
        passes.append(step.batch(rest, spans, is_prompt=False, chunk_size=group_chunk))
    return MambaMetadata(decode, prefill, tuple(passes), chunk_size)


def _cumsum(values: Sequence[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def _tensor(values, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=HOST).to(device, non_blocking=True)


class MambaStep(GroupStepBuilder):
    """A Mamba group's step: its metadata, with the states of "align" mode (prefix caching)
    planned and their copies run before the forward, and the draft states of requests
    verifying drafts; the Mamba kernels of the serving backend's name."""

    def __init__(self, group: GroupContext):
        super().__init__(group)
        self.kernels = get_mamba_backend(group.backend.name)
        self.chunk_size = group.model_config.mamba.chunk_size
        # Tokens between kept states in "align" mode; None: one state per request.
        self.interval = group.spec.block_size if group.spec.mamba_cache_mode == "align" else None
        self._copies: tuple[list[int], list[int]] | None = None
        # "align" mode: each request's draft-state blocks (beside its table).
        self._draft_blocks: dict[str, list[int]] = {}
        # This step's requests with drafts: (the block of the state after each of its tokens
        # but the last, the block a request that keeps j drafts keeps its state in), by id.
        self._draft_states: dict[str, tuple[list[int], list[int]]] = {}

    def add_request(self, request_id: str, draft_block_ids: list[int]) -> None:
        if draft_block_ids:
            self._draft_blocks[request_id] = list(draft_block_ids)

    def remove_request(self, request_id: str) -> None:
        self._draft_blocks.pop(request_id, None)

    def build(self, batch: StepBatch, block_rows: torch.Tensor) -> GroupStep:
        device, num_computed = self.group.device, batch.num_computed
        lens = (batch.query_lens, num_computed, batch.num_prompt_tokens)
        self._draft_states = {}
        if self.interval is None:
            slots = state_slots(block_rows)
            checkpoints = self._plan_draft_states(batch, block_rows, slots)
            metadata = build_mamba_metadata(
                *lens,
                slots,
                device,
                checkpoints=checkpoints,
                chunk_size=self.chunk_size,
                num_drafts=batch.num_drafts,
            )
            return GroupStep(metadata, self.kernels)
        rows = block_rows.tolist()
        plan = plan_align_states(rows, num_computed, batch.query_lens, self.interval)
        self._copies = plan.copies if plan.copies[0] else None
        drafts = self._plan_draft_states(batch, block_rows, plan.slots)
        checkpoints = plan.checkpoints
        if drafts is not None:
            checkpoints = [[*a, *b] for a, b in zip(plan.checkpoints, drafts, strict=True)]
        metadata = build_mamba_metadata(
            *lens,
            plan.slots,
            device,
            checkpoints=checkpoints,
            # Checkpoints must fall on chunk ends of the scan.
            chunk_size=math.gcd(self.chunk_size, self.interval),
            num_drafts=batch.num_drafts,
        )
        return GroupStep(metadata, self.kernels)

    def _plan_draft_states(self, batch: StepBatch, block_rows: torch.Tensor, slots: list[int]):
        """Checkpoints after each token of a request with k drafts but its last (its known
        token, then every draft but the last) into its k draft blocks
        (``MambaSpec.num_speculative_blocks``: in mode "none" blocks 1..k of its row, in
        "align" mode the ones it holds beside its table), and where the state of each count
        kept goes. None when no request has drafts."""
        if not any(batch.num_drafts):
            return None
        rows = block_rows.tolist()  # only for steps with drafts: the table is [R, W]
        checkpoints = []
        for index, num_drafts in enumerate(batch.num_drafts):
            if not num_drafts:
                checkpoints.append([])
                continue
            request_id = batch.request_ids[index]
            if self.interval is None:
                draft_slots = rows[index][1 : num_drafts + 1]
                keep_in = [slots[index]] * num_drafts
            else:
                draft_slots = self._draft_blocks.get(request_id, [])[:num_drafts]
                # Keeping j drafts leaves done + j + 1 tokens computed: their state belongs
                # in the block of that count's position.
                done = batch.num_computed[index]
                keep_in = [
                    rows[index][-(-(done + j + 1) // self.interval) - 1] for j in range(num_drafts)
                ]
            if len(draft_slots) < num_drafts or 0 in draft_slots or 0 in keep_in:
                raise ValueError(
                    f"Request {request_id}: {num_drafts} drafts, but it holds "
                    f"{len(draft_slots)} draft states in group {self.group.index}"
                )
            checkpoints.append([(n, slot) for n, slot in enumerate(draft_slots, start=1)])
            self._draft_states[request_id] = (draft_slots, keep_in)
        return checkpoints

    def after_sampling(self, num_accepted: dict[str, int]) -> None:
        """Undo rejected drafts: a request that kept j of its k drafts takes the state after
        its known token and those j (its draft state j + 1) as its state; one that kept all
        has it where the step wrote it."""
        sources, targets = [], []
        for request_id, (draft_slots, keep_in) in self._draft_states.items():
            kept = num_accepted[request_id]
            if kept < len(draft_slots):
                sources.append(draft_slots[kept])
                targets.append(keep_in[kept])
        self._draft_states = {}
        self._copy(sources, targets)

    def before_forward(self) -> None:
        """Carry each "align" request's state into the block its step writes."""
        if self._copies is not None:
            self._copy(*self._copies)
            self._copies = None

    def _copy(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole states from blocks ``sources`` to ``targets`` in every layer."""
        if not sources:
            return
        source_ids = torch.tensor(sources, dtype=torch.int64, device=self.group.device)
        target_ids = torch.tensor(targets, dtype=torch.int64, device=self.group.device)
        for layer in self.group.layers:
            layer.copy_states(source_ids, target_ids)
