"""A minimal step driver for worker tests: allocates blocks from a counter (never reusing
them, so earlier requests' K/V stay valid for prefix hits), chunks prefills, and decodes.

It stands in for the scheduler, which lives in the cluster package; the runner under test only
ever sees step plans, exactly as it would from the controller.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore import KVCacheConfig
from workers.protocol import NewRequest, RequestDelta, StepPlan
from workers.sampling import SamplingParams


@dataclass
class DriverRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    block_ids: list[list[int]]
    num_prompt_tokens: int
    num_computed: int = 0
    num_output: int = 0
    is_new: bool = True


class StepDriver:
    def __init__(self, config: KVCacheConfig, execute):
        self.config = config
        self.execute = execute  # StepPlan -> StepResult (one rank, or all ranks)
        self.next_block = 1  # block 0 is the null block
        self.block_sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
        # A Mamba group without prefix caching holds one state block per request.
        self.max_blocks = [
            g.kv_cache_spec.max_num_blocks_per_req(config.max_model_len)
            for g in config.kv_cache_groups
        ]
        self.finished: dict[str, DriverRequest] = {}

    def prefix_hit(self, earlier_id: str, prompt: list[int]) -> tuple[list[list[int]], int]:
        """The blocks of finished request ``earlier_id`` that ``prompt`` can reuse: whole
        blocks of the common prefix, leaving at least one prompt token to compute."""
        earlier = self.finished[earlier_id]
        common = 0
        while (
            common < min(len(prompt) - 1, len(earlier.token_ids))
            and prompt[common] == earlier.token_ids[common]
        ):
            common += 1
        block = max(self.block_sizes)
        num_tokens = common // block * block
        blocks = [
            ids[: num_tokens // size]
            for ids, size in zip(earlier.block_ids, self.block_sizes, strict=True)
        ]
        return blocks, num_tokens

    def _grow(self, request: DriverRequest, num_tokens: int) -> list[list[int]]:
        added = []
        for group, size in enumerate(self.block_sizes):
            needed = min(-(-num_tokens // size), self.max_blocks[group])
            needed -= len(request.block_ids[group])
            new = list(range(self.next_block, self.next_block + max(needed, 0)))
            self.next_block += len(new)
            if self.next_block > self.config.num_blocks:
                raise RuntimeError("the test's KV cache is too small")
            request.block_ids[group].extend(new)
            added.append(new)
        return added

    def generate(
        self,
        requests: list[tuple[str, list[int], int]],
        *,
        chunk: int = 10_000,
        sampling: SamplingParams | None = None,
        prefix_from=None,
        preempt_after: dict[str, int] | None = None,
    ) -> dict[str, list[int]]:
        """Run ``(request_id, prompt, max_tokens)`` requests together to completion.

        ``prefix_from`` maps a request id to ``(block_ids_per_group, num_tokens)`` of cached
        blocks it may reuse (a prefix-cache hit). ``preempt_after`` maps a request id to a
        number of outputs after which it is preempted once: it comes back as a new request
        that recomputes its prompt and outputs, in the same (stale) blocks.
        """
        preempt_after = dict(preempt_after or {})
        sampling = sampling or SamplingParams(temperature=0.0, max_tokens=1)
        live = [self._start(request, sampling, prefix_from or {}) for request in requests]
        outputs = {r.request_id: [] for r in live}
        while live:
            result = self.execute(self._step_plan(live, chunk))
            finished = []
            for r in live:
                if r.request_id in result.sampled:
                    token = result.sampled[r.request_id]
                    r.token_ids.append(token)
                    r.num_output += 1
                    outputs[r.request_id].append(token)
                    if len(outputs[r.request_id]) >= r.max_tokens:
                        finished.append(r)
            for r in live:
                if r not in finished and preempt_after.get(r.request_id) == r.num_output:
                    del preempt_after[r.request_id]
                    self.execute(StepPlan(preempted_ids=[r.request_id]))
                    r.is_new, r.num_computed = True, 0
            for r in finished:
                live.remove(r)
                self.finished[r.request_id] = r
            if finished:
                self.execute(StepPlan(finished_ids=[r.request_id for r in finished]))
        return outputs

    def _start(self, request, sampling: SamplingParams, prefix_from) -> DriverRequest:
        request_id, prompt, max_tokens = request
        hit_blocks, hit_tokens = prefix_from.get(request_id, ([[]] * len(self.block_sizes), 0))
        return DriverRequest(
            request_id,
            list(prompt),
            sampling,
            max_tokens,
            [list(b) for b in hit_blocks],
            num_prompt_tokens=len(prompt),
            num_computed=hit_tokens,
        )

    def _step_plan(self, live: list[DriverRequest], chunk: int) -> StepPlan:
        """The next step: every live request's next chunk, new ones sent whole."""
        new_requests, deltas = [], []
        for r in live:
            todo = min(chunk, len(r.token_ids) - r.num_computed)
            added = self._grow(r, r.num_computed + todo)
            if r.is_new:
                new_requests.append(
                    NewRequest(
                        request_id=r.request_id,
                        token_ids=list(r.token_ids),
                        sampling=r.sampling,
                        block_ids=[list(b) for b in r.block_ids],
                        num_computed_tokens=r.num_computed,
                        num_new_tokens=todo,
                        num_prompt_tokens=r.num_prompt_tokens,
                    )
                )
                r.is_new = False
            else:
                deltas.append(
                    RequestDelta(
                        request_id=r.request_id,
                        new_block_ids=added,
                        num_computed_tokens=r.num_computed,
                        num_new_tokens=todo,
                    )
                )
            r.num_computed += todo
        return StepPlan(new_requests=new_requests, deltas=deltas)
