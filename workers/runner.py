"""The model runner: executes one step plan on this rank's model shard and KV cache.

It keeps, per live request, the tokens known so far, the block ids of every KV-cache group and
the sampling parameters; each step it flattens the scheduled tokens into one batch, asks each
group's step builder (made by the kind of the group's layers, ``workers.kinds``) for the
group's metadata and kernels, runs the forward, and samples on rank 0 for every request whose
known tokens are all computed. Rank 0's tokens are broadcast so every rank's token history
stays identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend
from kvcore import KVCacheConfig
from kvcore._math import cdiv
from workers.block_table import BlockTable
from workers.forward_context import ForwardContext, set_forward_context
from workers.grammar.matchers import GrammarMatchers
from workers.group_step import GroupContext, GroupStepBuilder, StepBatch, StepLimits
from workers.kinds import kind_of_spec
from workers.parallel import broadcast_from_first, get_tp_group
from workers.protocol import NewRequest, RequestDelta, StepPlan, StepResult, TokenLogprobs
from workers.sampler import GrammarMasks, Sampler, SamplingRow
from workers.sampling import SamplingParams


@dataclass
class RunnerRequest:
    token_ids: list[int]  # the prompt, then every output so far
    num_prompt_tokens: int
    sampling: SamplingParams


class ModelRunner:
    def __init__(
        self,
        model,
        backend: AttentionBackend,
        config: KVCacheConfig,
        device: torch.device | str = "cpu",
        # The largest step: the memory profile's, whose scratch a step's metadata stays within.
        limits: StepLimits | None = None,
        # Makes the vocabulary constrained requests' grammars were compiled against (an
        # xgrammar.TokenizerInfo); called once, at the first constrained request. None: this
        # runner refuses constrained requests.
        grammar_vocabulary=None,
    ):
        self.model = model
        self.backend = backend
        self.config = config
        self.device = torch.device(device)
        self.requests: dict[str, RunnerRequest] = {}
        grammars = None if grammar_vocabulary is None else GrammarMatchers(grammar_vocabulary)
        self.sampler = Sampler(self.device, model.config.eos_token_ids, grammars)
        # One table per KV-cache group, rows updated by each step's deltas.
        self.block_tables = [
            BlockTable(cdiv(config.max_model_len, group.kv_cache_spec.block_size))
            for group in config.kv_cache_groups
        ]
        self.group_steps = self._group_step_builders(limits or StepLimits())
        # Which group each cache layer's blocks come from.
        self.layer_groups = {
            name: index
            for index, group in enumerate(config.kv_cache_groups)
            for name in group.layer_names
        }

    def _group_step_builders(self, limits: StepLimits) -> list[GroupStepBuilder]:
        """One per group, made by the kind of its layers."""
        layers = self.model.kv_cache_layers()
        builders = []
        for index, group in enumerate(self.config.kv_cache_groups):
            spec = group.layer_spec(group.layer_names[0])
            context = GroupContext(
                index=index,
                spec=spec,
                layers=[layers[name] for name in group.layer_names],
                model_config=self.model.config,
                backend=self.backend,
                device=self.device,
                limits=limits,
            )
            builders.append(kind_of_spec(spec).builder_class()(context))
        return builders

    def execute(self, plan: StepPlan) -> StepResult:
        self._update_state(plan)
        batch = self._schedule(plan)
        if not batch.request_ids:
            return StepResult()
        request_ids, last_indices = self._sampled_rows(batch)
        # The rows rank 0 samples, made once: their bitmasks are filled during the forward.
        rows = [self._sampling_row(r) for r in request_ids] if get_tp_group().is_first_rank else []
        hidden, forward_seconds, masks = self._forward(batch, rows)
        sampled, logprobs, refused = self._sample(request_ids, last_indices, rows, masks, hidden)
        return StepResult(
            sampled=sampled, logprobs=logprobs, forward_seconds=forward_seconds, refused=refused
        )

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
            self.sampler.add_request(new.request_id, new.sampling, new.grammar)
        for delta in plan.deltas:
            if delta.request_id not in self.requests:
                raise ValueError(f"A delta for request {delta.request_id!r}, which is not here")
            for table, added in zip(self.block_tables, delta.new_block_ids, strict=True):
                table.append(delta.request_id, added)

    def _schedule(self, plan: StepPlan) -> StepBatch:
        batch = StepBatch([], [], [], [], [], [])
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
            batch.num_prompt_tokens.append(state.num_prompt_tokens)
            batch.token_ids.extend(state.token_ids[start:end])
            batch.positions.extend(range(start, end))
        return batch

    def _sampled_rows(self, batch: StepBatch) -> tuple[list[str], list[int]]:
        """The requests whose known tokens are all computed this step (they sample), and the
        index of each one's last token in the batch."""
        rows, last_indices = [], []
        end = 0
        for request_id, query_len, seq_len in zip(
            batch.request_ids, batch.query_lens, batch.seq_lens, strict=True
        ):
            end += query_len
            if seq_len == len(self.requests[request_id].token_ids):
                rows.append(request_id)
                last_indices.append(end - 1)
        return rows, last_indices

    def _forward(
        self, batch: StepBatch, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, float, GrammarMasks | None]:
        """Hidden states ``[T, hidden]``, the seconds of the model call alone (metadata
        building counts as step overhead), and the bitmasks of ``rows`` that are constrained,
        filled while the device runs the forward (on a CPU, simply after it)."""
        steps = [
            builder.build(batch, table.rows(batch.request_ids))
            for builder, table in zip(self.group_steps, self.block_tables, strict=True)
        ]
        context = ForwardContext({name: steps[i] for name, i in self.layer_groups.items()})
        token_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        with torch.inference_mode(), set_forward_context(context):
            for builder in self.group_steps:
                builder.before_forward()
            started = time.perf_counter()
            hidden = self.model(token_ids, positions)  # [T, hidden]
            is_async = self.device.type == "cuda"
            masks = None
            if is_async:  # the kernels are queued: fill the masks while they run
                masks = self.sampler.fill_masks(rows)
                torch.cuda.synchronize(self.device)  # ... then time them
            elapsed = time.perf_counter() - started
            if not is_async:
                masks = self.sampler.fill_masks(rows)
            return hidden, elapsed, masks

    def _sample(
        self,
        request_ids: list[str],
        last_indices: list[int],
        rows: list[SamplingRow],
        masks: GrammarMasks | None,
        hidden: torch.Tensor,
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs], list[str]]:
        """Tokens for the requests whose known tokens are all computed (rank 0 draws from
        ``rows``, every rank takes its tokens), the log-probabilities asked for and the
        constrained requests whose grammar refused their token (rank 0's)."""
        if not request_ids:
            return {}, {}, []
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[last_indices])  # [R, vocab]
        logprobs, refused = {}, []
        if get_tp_group().is_first_rank:
            sampled = self.sampler.sample_rows(logits, rows, masks)
            tokens, logprobs = sampled.tokens, sampled.logprobs  # [R] int64 on self.device
            refused = sampled.refused
        else:
            tokens = torch.empty(len(request_ids), dtype=torch.int64, device=self.device)
        tokens = broadcast_from_first(tokens).tolist()
        for request_id, token in zip(request_ids, tokens, strict=True):
            self.requests[request_id].token_ids.append(token)
        return dict(zip(request_ids, tokens, strict=True)), logprobs, refused

    def _sampling_row(self, request_id: str) -> SamplingRow:
        state = self.requests[request_id]
        split = state.num_prompt_tokens
        return SamplingRow(
            request_id, state.sampling, state.token_ids[:split], state.token_ids[split:]
        )
