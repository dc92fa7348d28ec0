"""Steps in flight through two pipeline stages, in this process: the real scheduler plans a
step per micro-batch while the others run, and the stages run them as ``StagedTransport``
submits them to their actors. The first stage runs a step as soon as it is sent, after taking
the tokens of the steps answered before it; the last answers the oldest. Greedy tokens equal
transformers', with chunked prefill, a preemption, a prefix hit and a request aborted while its
step runs; and no step ever carries a request whose token a step in flight still owes."""

from __future__ import annotations

from collections import deque

import msgspec
import pytest

from cluster.output.detokenizer import IncrementalDetokenizer
from cluster.scheduler.request import EngineRequest
from cluster.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from kvcore.coordinator import KVCacheCoordinator
from kvcore.kv_request import KVRequest
from tests.workers.hf_models import PROMPTS, reference_generations
from tests.workers.stage_helpers import stage_workers
from workers.protocol import StepPlan, StepResult
from workers.sampling import SamplingParams
from workers.tokenizer import ByteTokenizer

NUM_TOKENS = 12
BUDGET = 8  # tokens per step: the long prompts arrive in chunks
ABORTED = "aborted"


class StagesInFlight:
    """Two stage workers driven in the order their actors run a step sent through
    ``StagedTransport``."""

    def __init__(self, first, last):
        self.first, self.last = first, last
        self.owed: list[tuple[StepPlan, StepResult]] = []
        self.running: deque = deque()  # (plan, the first stage's hidden states), oldest first

    def send(self, plan: StepPlan) -> None:
        for plan_before, result in self.owed:
            self.first.runner.take_sampled(plan_before, result)
        self.owed = []
        self.running.append((plan, self.first.runner.run_stage(plan)))

    def answer_oldest(self) -> StepResult:
        plan, hidden = self.running.popleft()
        result = self.last.runner.execute(plan, hidden)
        self.owed.append((plan, result))
        return result


def scheduler_for(first, last, num_blocks: int) -> Scheduler:
    """The engine's scheduler over ``num_blocks`` of the blocks both stages hold."""
    config = min(first.runner.config, last.runner.config, key=lambda c: c.num_blocks)
    config = msgspec.structs.replace(config, num_blocks=min(num_blocks, config.num_blocks))
    coordinator = KVCacheCoordinator.from_config(
        config, max_num_batched_tokens=BUDGET, enable_caching=True
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=BUDGET,
        max_model_len=config.max_model_len,
        micro_batches=2,
    )
    return Scheduler(coordinator, scheduler_config)


def engine_request(request_id: str, prompt: list[int], index: int) -> EngineRequest:
    return EngineRequest(
        request_id,
        KVRequest(request_id, prompt, hash_block_size=4),
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
        IncrementalDetokenizer(ByteTokenizer()),
        index,
    )


class Engine:
    """The engine's loop over the stages, one step per micro-batch in flight."""

    def __init__(self, scheduler: Scheduler, stages: StagesInFlight):
        self.scheduler, self.stages = scheduler, stages
        self.sent: deque[tuple[ScheduledStep, set[str]]] = deque()  # step, whom it samples for
        self.most_in_flight = 0
        self.outputs: dict[str, list[int]] = {}
        self.finished: list[EngineRequest] = []  # in the order they ended by length

    def run(self) -> None:
        scheduler = self.scheduler
        while scheduler.has_work or self.sent:
            if not self.sent:
                self._send(scheduler.schedule())
            while len(self.sent) < scheduler.max_steps_in_flight and scheduler.has_work:
                if not self._send(scheduler.schedule(ahead=True)):
                    break
            self.most_in_flight = max(self.most_in_flight, len(self.sent))
            self._answer()

    def _send(self, step: ScheduledStep) -> bool:
        if step.is_empty:
            return False
        owing = set().union(*(samples for _, samples in self.sent))
        carried = {request.request_id for request, _ in step.scheduled}
        assert not carried & owing, "a step carries a request whose token is still owed"
        samples = {r.request_id for r, _ in step.scheduled if r.num_inflight_samples}
        self.stages.send(step.plan)
        self.sent.append((step, samples))
        if ABORTED in samples:  # its client leaves while the step runs
            self.scheduler.abort(ABORTED)
        return True

    def _answer(self) -> None:
        step, _ = self.sent.popleft()
        touched, failed = self.scheduler.update(step, self.stages.answer_oldest())
        assert not failed
        for request in touched:
            if request.num_output_tokens >= NUM_TOKENS:
                self.outputs[request.request_id] = request.output_token_ids
                self.scheduler.finish(request, "length")
                self.finished.append(request)


@pytest.mark.parametrize(("name", "num_blocks"), [("llama", 20), ("nemotron-h", 24)])
def test_steps_in_flight_through_two_stages_give_the_tokens_of_transformers(
    checkpoints, name, num_blocks
):
    model_dir, layout, _ = checkpoints(name)
    first, last = stage_workers(model_dir, layout)
    scheduler = scheduler_for(first, last, num_blocks)
    idle = scheduler.coordinator.num_free_blocks
    assert scheduler.max_steps_in_flight == 2
    engine = Engine(scheduler, StagesInFlight(first, last))
    for index, prompt in enumerate(PROMPTS):
        scheduler.add(engine_request(f"r{index}", prompt, index))
    scheduler.add(engine_request(ABORTED, [40, 41, 42, 43], len(PROMPTS)))
    engine.run()
    expected = reference_generations(model_dir, PROMPTS, NUM_TOKENS)
    assert engine.outputs == {f"r{i}": tokens for i, tokens in enumerate(expected)}
    assert engine.most_in_flight == 2  # the stages had two steps at once
    assert scheduler.num_preemptions > 0
    # A prompt that starts with the last request's tokens reads its blocks (still cached)
    # on both stages; alone, its chunks follow each other through the stages.
    last_done = engine.finished[-1]
    hit_prompt = last_done.kv.token_ids[: last_done.num_prompt_tokens + 6]
    scheduler.add(engine_request("hit", hit_prompt, len(PROMPTS) + 1))
    engine.run()
    assert scheduler.prefix_hit_tokens > 0
    assert engine.outputs["hit"] == reference_generations(model_dir, [hit_prompt], NUM_TOKENS)[0]
    assert scheduler.coordinator.num_free_blocks == idle
    assert not first.runner.requests and not last.runner.requests
