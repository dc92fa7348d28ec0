"""The model runner: executes one step plan on this rank's model shard and KV cache.

It keeps, per live request, the tokens known so far, the block ids of every KV-cache group and
the sampling parameters; each step it flattens the scheduled tokens into one batch, builds
metadata once per KV-cache group (attention metadata, or a Mamba group's state slots,
``workers.mamba_metadata``), runs the forward, and samples on rank 0 for every request whose
known tokens are all computed. Rank 0's tokens are broadcast so every rank's
token history stays identical.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend
from kvcore import KVCacheConfig, MambaSpec, MLAAttentionSpec, iter_layer_specs
from kvcore._math import cdiv
from workers.block_table import BlockTable
from workers.forward_context import ForwardContext, set_forward_context
from workers.mamba_metadata import build_mamba_metadata, plan_align_states, state_slots
from workers.mla_metadata import build_mla_metadata, expansion_threshold
from workers.options import RankSettings
from workers.parallel import broadcast_from_first, get_tp_group
from workers.protocol import NewRequest, RequestDelta, StepPlan, StepResult, TokenLogprobs
from workers.sampler import Sampler, SamplingRow
from workers.sampling import SamplingParams


@dataclass
class RunnerRequest:
    token_ids: list[int]  # the prompt, then every output so far
    num_prompt_tokens: int
    sampling: SamplingParams


@dataclass
class ScheduledBatch:
    request_ids: list[str]
    query_lens: list[int]
    seq_lens: list[int]
    token_ids: list[int]
    positions: list[int]


class ModelRunner:
    def __init__(
        self,
        model,
        backend: AttentionBackend,
        config: KVCacheConfig,
        device: torch.device | str = "cpu",
        mamba_backend=None,  # kernels.mamba's backend, for models with Mamba layers
        mla_backend=None,  # kernels.mla's backend, for models with latent attention
        # The most context tokens an MLA step expands to per-head K/V: the largest step's
        # token count, which the memory profile ran (see workers.mla_metadata).
        mla_expand_budget: int = RankSettings.default("max_num_batched_tokens"),
        # The most latent rows one MLA decode-kernel call takes (its workspace grows with
        # them): the most decode rows a step has, which the memory profile ran.
        mla_max_latent_rows: int = RankSettings.default("max_num_seqs"),
    ):
        self.model = model
        self.backend = backend
        self.mamba_backend = mamba_backend
        self.mla_backend = mla_backend
        self.mla_expand_budget = mla_expand_budget
        self.mla_max_latent_rows = mla_max_latent_rows
        mla = model.config.mla
        self.mla_min_expanded_query_len = 2 if mla is None else expansion_threshold(mla)
        self.config = config
        self.device = torch.device(device)
        self.requests: dict[str, RunnerRequest] = {}
        self.sampler = Sampler(self.device, model.config.eos_token_ids)
        # One table per KV-cache group, rows updated by each step's deltas.
        self.block_tables = [
            BlockTable(cdiv(config.max_model_len, group.kv_cache_spec.block_size))
            for group in config.kv_cache_groups
        ]
        # Groups of recurrent states (each layer of a group is of one kind), and the state
        # interval of those in "align" mode (None: one state per request).
        groups = config.kv_cache_groups
        first_specs = [next(iter(iter_layer_specs(group.kv_cache_spec))) for group in groups]
        self.is_mamba_group = [isinstance(spec, MambaSpec) for spec in first_specs]
        self.is_latent_group = [isinstance(spec, MLAAttentionSpec) for spec in first_specs]
        self.state_intervals = [
            spec.block_size
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
            else None
            for spec in first_specs
        ]
        # The state copies an "align" step makes run layer by layer, before the forward.
        self._pending_copies: list[tuple[int, list[int], list[int]]] = []
        layers = model.kv_cache_layers()
        self._state_layers = {
            index: [layers[name] for name in groups[index].layer_names]
            for index, interval in enumerate(self.state_intervals)
            if interval is not None
        }
        # Which group each cache layer's blocks come from.
        self.layer_groups = {
            name: index
            for index, group in enumerate(config.kv_cache_groups)
            for name in group.layer_names
        }

    def execute(self, plan: StepPlan) -> StepResult:
        self._update_state(plan)
        batch = self._schedule(plan)
        if not batch.request_ids:
            return StepResult()
        hidden, forward_seconds = self._forward(batch)
        sampled, logprobs = self._sample(batch, hidden)
        return StepResult(sampled=sampled, logprobs=logprobs, forward_seconds=forward_seconds)

    def _update_state(self, plan: StepPlan) -> None:
        for request_id in [*plan.preempted_ids, *plan.finished_ids]:
            self.requests.pop(request_id, None)
            for table in self.block_tables:
                table.remove(request_id)
        for request_id in plan.finished_ids:
            self.sampler.remove_request(request_id)
        for new in plan.new_requests:
            num_prompt = new.num_prompt_tokens
            if num_prompt is None:
                num_prompt = len(new.token_ids)
            self.requests[new.request_id] = RunnerRequest(
                token_ids=list(new.token_ids), num_prompt_tokens=num_prompt, sampling=new.sampling
            )
            for table, ids in zip(self.block_tables, new.block_ids, strict=True):
                table.add(new.request_id, ids)
            self.sampler.add_request(new.request_id, new.sampling)
        for delta in plan.deltas:
            if delta.request_id not in self.requests:
                raise ValueError(f"A delta for request {delta.request_id!r}, which is not here")
            for table, added in zip(self.block_tables, delta.new_block_ids, strict=True):
                table.append(delta.request_id, added)

    def _schedule(self, plan: StepPlan) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [], [], [])
        entries: list[NewRequest | RequestDelta] = [*plan.new_requests, *plan.deltas]
        for entry in entries:
            if entry.num_new_tokens <= 0:
                continue
            state = self.requests[entry.request_id]
            start, end = entry.num_computed_tokens, entry.num_computed_tokens + entry.num_new_tokens
            if end > len(state.token_ids):
                raise ValueError(
                    f"Request {entry.request_id}: asked to compute tokens up to {end}, but only "
                    f"{len(state.token_ids)} are known"
                )
            batch.request_ids.append(entry.request_id)
            batch.query_lens.append(entry.num_new_tokens)
            batch.seq_lens.append(end)
            batch.token_ids.extend(state.token_ids[start:end])
            batch.positions.extend(range(start, end))
        return batch

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, float]:
        """Hidden states ``[T, hidden]``, and the seconds of the model call alone (metadata
        building counts as step overhead)."""
        metadata_per_group = [
            self._group_metadata(batch, index) for index in range(len(self.block_tables))
        ]
        context = ForwardContext(
            backend=self.backend,
            metadata_by_layer={
                name: metadata_per_group[index] for name, index in self.layer_groups.items()
            },
            mamba_backend=self.mamba_backend,
            mla_backend=self.mla_backend,
        )
        token_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        with torch.inference_mode(), set_forward_context(context):
            self._copy_states()
            started = time.perf_counter()
            hidden = self.model(token_ids, positions)  # [T, hidden]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # kernels run asynchronously: time them
            return hidden, time.perf_counter() - started

    def _group_metadata(self, batch: ScheduledBatch, group_index: int):
        rows = self.block_tables[group_index].rows(batch.request_ids)
        if not self.is_mamba_group[group_index]:
            block_size = self.config.kv_cache_groups[group_index].kv_cache_spec.block_size
            metadata = self.backend.build_metadata(
                batch.query_lens, batch.seq_lens, rows, block_size, self.device
            )
            if not self.is_latent_group[group_index]:
                return metadata
            return build_mla_metadata(
                metadata,
                batch.query_lens,
                batch.seq_lens,
                rows,
                self.device,
                self.mla_expand_budget,
                self.mla_min_expanded_query_len,
                self.mla_max_latent_rows,
            )
        num_computed = [s - q for s, q in zip(batch.seq_lens, batch.query_lens, strict=True)]
        num_prompt = [self.requests[r].num_prompt_tokens for r in batch.request_ids]
        interval = self.state_intervals[group_index]
        chunk_size = self.model.config.mamba.chunk_size
        if interval is None:
            return build_mamba_metadata(
                batch.query_lens,
                num_computed,
                num_prompt,
                state_slots(rows),
                self.device,
                chunk_size=chunk_size,
            )
        plan = plan_align_states(rows.tolist(), num_computed, batch.query_lens, interval)
        if plan.copies[0]:
            self._pending_copies.append((group_index, *plan.copies))
        return build_mamba_metadata(
            batch.query_lens,
            num_computed,
            num_prompt,
            plan.slots,
            self.device,
            checkpoints=plan.checkpoints,
            # Checkpoints must fall on chunk ends of the scan.
            chunk_size=math.gcd(chunk_size, interval),
        )

    def _copy_states(self) -> None:
        """Carry each "align" request's state into the block its step writes."""
        for group_index, sources, targets in self._pending_copies:
            source_ids = torch.tensor(sources, dtype=torch.int64, device=self.device)
            target_ids = torch.tensor(targets, dtype=torch.int64, device=self.device)
            for layer in self._state_layers[group_index]:
                layer.copy_states(source_ids, target_ids)
        self._pending_copies.clear()

    def _sample(
        self, batch: ScheduledBatch, hidden: torch.Tensor
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Tokens for the requests whose known tokens are all computed (rank 0 draws, every
        rank takes its tokens), and the log-probabilities asked for (rank 0's)."""
        rows, last_indices = [], []
        end = 0
        for request_id, query_len, seq_len in zip(
            batch.request_ids, batch.query_lens, batch.seq_lens, strict=True
        ):
            end += query_len
            if seq_len == len(self.requests[request_id].token_ids):
                rows.append(request_id)
                last_indices.append(end - 1)
        if not rows:
            return {}, {}
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[last_indices])  # [R, vocab]
        logprobs = {}
        if get_tp_group().is_first_rank:
            sampled = self.sampler.sample_rows(logits, [self._sampling_row(r) for r in rows])
            tokens, logprobs = sampled.tokens, sampled.logprobs  # [R] int64 on self.device
        else:
            tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        tokens = broadcast_from_first(tokens).tolist()
        for request_id, token in zip(rows, tokens, strict=True):
            self.requests[request_id].token_ids.append(token)
        return dict(zip(rows, tokens, strict=True)), logprobs

    def _sampling_row(self, request_id: str) -> SamplingRow:
        state = self.requests[request_id]
        split = state.num_prompt_tokens
        return SamplingRow(
            request_id, state.sampling, state.token_ids[:split], state.token_ids[split:]
        )
