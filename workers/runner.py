"""The model runner: executes one step plan on this rank's model shard and KV cache.

It keeps, per live request, the tokens known so far, the block ids of every KV-cache group and
the sampling parameters; each step it flattens the scheduled tokens into one batch, asks each
group's step builder (made by the kind of the group's layers, ``workers.kinds``) for the
group's metadata and kernels, runs the forward, and samples on rank 0 for every request whose
known tokens are all computed. Rank 0's tokens are broadcast so every rank's token history
stays identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend
from kvcore import KVCacheConfig
from kvcore._math import cdiv
from workers.block_table import BlockTable
from workers.cuda_graphs import DecodeGraphs, graph_batch_sizes
from workers.device_timing import DeviceTimer, to_host_list
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
        # One table per KV-cache group, rows updated by each step's deltas: wide enough for a
        # block per position, or whatever more a request holds (a state and its drafts').
        self.block_tables = [
            BlockTable(
                max(
                    cdiv(config.max_model_len, group.kv_cache_spec.block_size),
                    group.kv_cache_spec.max_num_blocks_per_req(config.max_model_len),
                )
            )
            for group in config.kv_cache_groups
        ]
        self.limits = limits or StepLimits()
        self.group_steps = self._group_step_builders(self.limits)
        # Which group each cache layer's blocks come from.
        self.layer_groups = {
            name: index
            for index, group in enumerate(config.kv_cache_groups)
            for name in group.layer_names
        }
        self.graphs: DecodeGraphs | None = None  # eager until use_decode_graphs()

    def use_decode_graphs(self, mode: str = "cuda") -> bool:
        """Capture decode graphs (``workers.cuda_graphs``; ``mode="emulate"`` on CPUs, for
        tests) once the KV cache is bound. False when a group's kind or backend cannot be
        captured: decode stays eager."""
        self.graphs = DecodeGraphs.for_runner(
            self.model,
            self.group_steps,
            self.layer_groups,
            [table.width for table in self.block_tables],
            graph_batch_sizes(self.limits.max_num_seqs),
            self.device,
            mode,
        )
        if self.graphs is not None:
            self.graphs.capture_all()
        return self.graphs is not None

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

    def execute(self, plan: StepPlan, hidden: torch.Tensor | None = None) -> StepResult:
        """One step on the last (or only) pipeline stage, through sampling. ``hidden``: the
        previous stage's output, on every stage but the first."""
        self._update_state(plan)
        drafts = {d.request_id: d.draft_token_ids for d in plan.deltas if d.draft_token_ids}
        batch = self._schedule(plan, drafts)
        if not batch.request_ids:
            return StepResult()
        request_ids, row_indices = self._sampled_rows(batch, drafts)
        # The rows rank 0 samples, made once: their bitmasks are filled during the forward.
        rows = self._sampling_rows(request_ids, drafts) if get_tp_group().is_first_rank else []
        timer = DeviceTimer(self.device)
        hidden, masks = self._forward(batch, rows, timer, hidden)
        logits = self._logits(hidden, row_indices, timer)
        sampled, logprobs, refused, accepted = self._sample(
            request_ids, drafts, rows, masks, logits
        )
        if drafts:
            for builder in self.group_steps:
                builder.after_sampling(accepted)
        return StepResult(
            sampled=sampled,
            logprobs=logprobs,
            forward_seconds=timer.seconds(),
            refused=refused,
            num_accepted=accepted,
        )

    def run_stage(self, plan: StepPlan, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One step on a pipeline stage before the last: the plan's tokens through this
        stage's layers, whose hidden states ``[T, hidden]`` the next stage takes. ``hidden``:
        the previous stage's output (none on the first)."""
        self._update_state(plan)
        drafts = {d.request_id: d.draft_token_ids for d in plan.deltas if d.draft_token_ids}
        batch = self._schedule(plan, drafts)
        if not batch.request_ids:
            return torch.empty(0, self.model.config.hidden_size, device=self.device)
        out, _ = self._forward(batch, [], DeviceTimer(self.device), hidden)
        return out

    def take_sampled(self, plan: StepPlan, result: StepResult) -> None:
        """On a stage before the last, after ``plan`` ran through the last: the tokens it
        sampled (after the drafts it accepted), which this stage's later steps read as the
        last stage's do. A request a later step ended (aborted while this one ran, when
        steps are in flight) is gone already and takes nothing."""
        drafts = {d.request_id: d.draft_token_ids for d in plan.deltas if d.draft_token_ids}
        for request_id, token in result.sampled.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            kept = result.num_accepted.get(request_id, 0)
            request.token_ids.extend([*drafts.get(request_id, ())[:kept], token])
        if drafts:
            for builder in self.group_steps:
                builder.after_sampling(result.num_accepted)

    def _update_state(self, plan: StepPlan) -> None:
        for request_id in [*plan.preempted_ids, *plan.finished_ids]:
            self.requests.pop(request_id, None)
            for table in self.block_tables:
                table.remove(request_id)
            for builder in self.group_steps:
                builder.remove_request(request_id)
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
            drafts = new.draft_block_ids or [[] for _ in self.group_steps]
            for builder, ids in zip(self.group_steps, drafts, strict=True):
                builder.add_request(new.request_id, ids)
            self.sampler.add_request(new.request_id, new.sampling, new.grammar)
        for delta in plan.deltas:
            if delta.request_id not in self.requests:
                raise ValueError(f"A delta for request {delta.request_id!r}, which is not here")
            for table, added in zip(self.block_tables, delta.new_block_ids, strict=True):
                table.append(delta.request_id, added)

    def _schedule(self, plan: StepPlan, drafts: dict[str, list[int]]) -> StepBatch:
        batch = StepBatch([], [], [], [], [], [], [])
        entries: list[NewRequest | RequestDelta] = [*plan.new_requests, *plan.deltas]
        for entry in entries:
            if entry.num_new_tokens <= 0:
                continue
            state = self.requests[entry.request_id]
            start, end = entry.num_computed_tokens, entry.num_computed_tokens + entry.num_new_tokens
            draft = drafts.get(entry.request_id, [])
            known_end = end - len(draft)
            if known_end > len(state.token_ids) or known_end <= start:
                raise ValueError(
                    f"Request {entry.request_id}: asked to compute tokens up to {known_end} "
                    f"(then {len(draft)} drafts), but {len(state.token_ids)} are known"
                )
            if draft:
                _check_draftable(entry.request_id, state, known_end)
            batch.request_ids.append(entry.request_id)
            batch.query_lens.append(entry.num_new_tokens)
            batch.seq_lens.append(end)
            batch.num_prompt_tokens.append(state.num_prompt_tokens)
            batch.token_ids.extend(state.token_ids[start:known_end])
            batch.token_ids.extend(draft)
            batch.positions.extend(range(start, end))
            batch.num_drafts.append(len(draft))
        return batch

    def _sampled_rows(
        self, batch: StepBatch, drafts: dict[str, list[int]]
    ) -> tuple[list[str], list[int]]:
        """The requests whose known tokens are all computed this step (they sample), and the
        batch indices of their sampled rows: each one's last known token, then its drafts
        (a request with k drafts samples k + 1 rows)."""
        request_ids, indices = [], []
        end = 0
        for request_id, query_len, seq_len in zip(
            batch.request_ids, batch.query_lens, batch.seq_lens, strict=True
        ):
            end += query_len
            num_drafts = len(drafts.get(request_id, ()))
            if seq_len - num_drafts == len(self.requests[request_id].token_ids):
                request_ids.append(request_id)
                indices.extend(range(end - 1 - num_drafts, end))
        return request_ids, indices

    def _forward(
        self,
        batch: StepBatch,
        rows: list[SamplingRow],
        timer: DeviceTimer,
        hidden_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GrammarMasks | None]:
        """Hidden states ``[T, hidden]`` and the bitmasks of ``rows`` that are constrained,
        filled while the device runs the forward (on a CPU, simply after it). ``timer``
        times the model call alone: metadata building counts as step overhead.
        ``hidden_in``: the previous pipeline stage's hidden states."""
        tables = [table.rows(batch.request_ids) for table in self.block_tables]
        if hidden_in is None and self.graphs is not None and self.graphs.can_run(batch):
            size = self.graphs.load(batch, tables)
            timer.start()
            hidden = self.graphs.replay(size, len(batch.request_ids))
            timer.stop()
            return hidden, self.sampler.fill_masks(rows)
        steps = [
            builder.build(batch, rows_of_group)
            for builder, rows_of_group in zip(self.group_steps, tables, strict=True)
        ]
        context = ForwardContext({name: steps[i] for name, i in self.layer_groups.items()})
        token_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        with torch.inference_mode(), set_forward_context(context):
            for builder in self.group_steps:
                builder.before_forward()
            timer.start()
            hidden = self.model(token_ids, positions, hidden_in)  # [T, hidden]
            timer.stop()
            # On a GPU the kernels are queued and the host is free: the masks are filled while
            # they run. Nothing waits for the device until the tokens come back.
            return hidden, self.sampler.fill_masks(rows)

    def _logits(
        self, hidden: torch.Tensor, row_indices: list[int], timer: DeviceTimer
    ) -> torch.Tensor | None:
        """The sampled rows' logits ``[rows, vocab]``; the LM head is timed as part of the
        forward (at SmolLM2's 49152 words a tenth of a decode step)."""
        if not row_indices:
            return None
        with torch.inference_mode():
            timer.start()
            logits = self.model.compute_logits(hidden[row_indices])
            timer.stop()
        return logits

    def _sample(
        self,
        request_ids: list[str],
        drafts: dict[str, list[int]],
        rows: list[SamplingRow],
        masks: GrammarMasks | None,
        logits: torch.Tensor | None,
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs], list[str], dict[str, int]]:
        """Tokens for the requests whose known tokens are all computed (rank 0 draws from
        ``rows``, every rank takes its tokens), the log-probabilities asked for, the
        constrained requests whose grammar refused their token (rank 0's) and, for requests
        with drafts, how many were accepted: a request keeps its drafts up to the first one
        rejected, then the token sampled in that one's place (after all of them: the token
        sampled after the last)."""
        if logits is None:
            return {}, {}, [], {}
        num_rows = logits.shape[0]
        # With drafts, one broadcast carries the tokens, then each row's acceptance as 0/1;
        # every rank knows from the plan whether there are any.
        message_len = 2 * num_rows if drafts else num_rows
        logprobs, refused = {}, []
        if get_tp_group().is_first_rank:
            row_drafts = None
            if drafts:
                row_drafts = [t for r in request_ids for t in (*drafts.get(r, ()), None)]
            sampled = self.sampler.sample_rows(logits, rows, masks, row_drafts)
            message = sampled.tokens
            if drafts:
                message = torch.cat([message, sampled.accepted.to(torch.int64)])
            logprobs, refused = sampled.logprobs, sampled.refused
        else:
            message = torch.empty(message_len, dtype=torch.int64, device=self.device)
        message = to_host_list(broadcast_from_first(message))
        tokens, accepted = message[:num_rows], message[num_rows:]
        new_tokens, num_accepted = {}, {}
        row = 0
        for request_id in request_ids:
            draft = drafts.get(request_id, ())
            kept = 0
            while kept < len(draft) and accepted[row + kept]:
                kept += 1
            token = tokens[row + kept]
            self.requests[request_id].token_ids.extend([*draft[:kept], token])
            new_tokens[request_id] = token
            if draft:
                num_accepted[request_id] = kept
            row += len(draft) + 1
        return new_tokens, logprobs, refused, num_accepted

    def _sampling_rows(
        self, request_ids: list[str], drafts: dict[str, list[int]]
    ) -> list[SamplingRow]:
        """One row per sampled position: a request with drafts has one per draft, each with
        the drafts before it as outputs (penalties and min_tokens see them), then one more."""
        rows = []
        for request_id in request_ids:
            state = self.requests[request_id]
            split = state.num_prompt_tokens
            prompt, outputs = state.token_ids[:split], state.token_ids[split:]
            draft = drafts.get(request_id, [])
            for index in range(len(draft) + 1):
                row_outputs = [*outputs, *draft[:index]] if index else outputs
                rows.append(SamplingRow(request_id, state.sampling, prompt, row_outputs))
        return rows


def _check_draftable(request_id: str, state: RunnerRequest, known_end: int) -> None:
    """Drafts follow a request's last known token, and only where its sampling allows them
    (``SamplingParams.can_verify_drafts``)."""
    if known_end != len(state.token_ids):
        raise ValueError(f"Request {request_id}: drafts must follow its last known token")
    if not state.sampling.can_verify_drafts:
        raise ValueError(
            f"Request {request_id}: drafts are not verified for constrained requests or "
            "requests asking for logprobs"
        )
