"""The scheduler on the real coordinator, stepped by hand: budgets, chunking, prefix hits,
preemption (newest first) and every stop condition. The step results are written by the test,
standing in for the workers, so each decision can be asserted exactly."""

from __future__ import annotations

import pytest

from cluster.assembly import build_scheduler
from cluster.config import EngineConfig
from cluster.output.detokenizer import (
    CONTEXT_TOKENS,
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
)
from cluster.output.stop import end_stopped
from cluster.scheduler.request import EngineRequest, RequestStatus
from cluster.scheduler.scheduler import Scheduler, SchedulerConfig
from kvcore import FullAttentionSpec, get_kv_cache_config
from kvcore.coordinator import KVCacheCoordinator
from kvcore.kv_request import KVRequest
from workers.model_source import model_config_for
from workers.protocol import StepResult
from workers.sampling import SamplingParams
from workers.tokenizer import ByteTokenizer

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="float32")
EOS = ByteTokenizer.EOS


def kv_config(num_blocks=64, budget=16, caching=True, max_model_len=64):
    return get_kv_cache_config(
        {"l0": SPEC},
        1 << 20,
        "LBNHC",
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        num_blocks_override=num_blocks,
        enable_prefix_caching=caching,
    )


def make_scheduler(
    num_blocks=64, budget=16, max_num_seqs=8, caching=True, max_model_len=64, micro_batches=None
):
    config = kv_config(num_blocks, budget, caching, max_model_len)
    coordinator = KVCacheCoordinator.from_config(
        config, max_num_batched_tokens=budget, enable_caching=caching
    )
    return Scheduler(
        coordinator,
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            eos_token_ids=(EOS,),
            micro_batches=micro_batches,
        ),
    )


def request(request_id: str, prompt, index: int = 0, **sampling) -> EngineRequest:
    sampling = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **sampling})
    return EngineRequest(
        request_id,
        KVRequest(request_id, prompt, hash_block_size=4),
        sampling,
        IncrementalDetokenizer(ByteTokenizer()),
        index,
    )


def answer(scheduler: Scheduler, scheduled, result: StepResult) -> None:
    """Apply a step's result as the engine does: the scheduler takes the tokens in, then the
    output stage detokenizes them and ends the requests they stop."""
    touched, failed = scheduler.update(scheduled, result)
    assert not failed and not end_stopped(scheduler, touched)[1]


def step(scheduler: Scheduler, tokens: dict[str, int] | None = None, default: int = 65):
    """Schedule one step and answer it: every request that reaches its last token samples
    ``tokens[id]`` (or ``default``)."""
    scheduled = scheduler.schedule()
    sampled = {}
    for req, _ in scheduled.scheduled:
        if req.num_inflight_samples:  # its step reaches its last token
            sampled[req.request_id] = (tokens or {}).get(req.request_id, default)
    answer(scheduler, scheduled, StepResult(sampled=sampled))
    return scheduled


def test_token_budget_chunks_prefills_in_arrival_order():
    scheduler = make_scheduler(budget=16)
    scheduler.add(request("a", list(range(10)), 0))
    scheduler.add(request("b", list(range(20, 40)), 1))
    first = step(scheduler)
    assert [(r.request_id, n) for r, n in first.scheduled] == [("a", 10), ("b", 6)]
    assert [n.num_new_tokens for n in first.plan.new_requests] == [10, 6]
    second = step(scheduler)
    # a decodes one token; b's prefill goes on in a chunk of what the budget leaves.
    assert [(r.request_id, n) for r, n in second.scheduled] == [("a", 1), ("b", 14)]
    assert [d.request_id for d in second.plan.deltas] == ["a", "b"]
    assert second.plan.deltas[1].num_computed_tokens == 6


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2, budget=64)
    for i in range(3):
        scheduler.add(request(f"r{i}", [1, 2, 3], i))
    scheduled = step(scheduler)
    assert [r.request_id for r, _ in scheduled.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_prefix_hit_is_sent_as_computed_tokens():
    scheduler = make_scheduler(budget=64)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    scheduler.add(request("first", prompt, 0, max_tokens=1))
    step(scheduler)
    assert "first" not in scheduler.requests  # finished after one token
    scheduler.add(request("second", prompt, 1, max_tokens=1))
    plan = scheduler.schedule().plan
    (new,) = plan.new_requests
    assert (new.num_computed_tokens, new.num_new_tokens) == (12, 1)
    assert scheduler.requests["second"].num_cached_prompt_tokens == 12
    assert plan.finished_ids == ["first"]


def test_preemption_takes_the_newest_and_resumes_it_with_all_tokens():
    # 6 usable blocks of 4 tokens: one request at max_model_len fits, two do not.
    scheduler = make_scheduler(num_blocks=7, budget=64, max_model_len=24)
    scheduler.add(request("old", list(range(8)), 0, max_tokens=14))  # 2 blocks
    scheduler.add(request("new", list(range(50, 58)), 1, max_tokens=14))  # 2 blocks
    step(scheduler)
    for _ in range(8):  # decodes grow both tables until the pool runs dry
        step(scheduler)
    assert scheduler.num_preemptions >= 1
    assert scheduler.requests["new"].status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    assert scheduler.requests["old"].status is RequestStatus.RUNNING
    preempted_plan = None
    while scheduler.has_work and preempted_plan is None:
        scheduled = scheduler.schedule()
        resumed = [n for n in scheduled.plan.new_requests if n.request_id == "new"]
        if resumed:
            preempted_plan = resumed[0]
        sampled = {r.request_id: 66 for r, _ in scheduled.scheduled if r.num_inflight_samples}
        answer(scheduler, scheduled, StepResult(sampled=sampled))
    assert preempted_plan is not None
    # The resumed request carries its prompt and the outputs it had made.
    assert preempted_plan.token_ids[:8] == list(range(50, 58))
    assert len(preempted_plan.token_ids) > 8


def test_stop_conditions():
    scheduler = make_scheduler(budget=64)
    reqs = {
        "eos": request("eos", [1, 2], 0),
        "ignore": request("ignore", [1, 2], 1, ignore_eos=True, max_tokens=2),
        "stop-id": request("stop-id", [1, 2], 2, stop_token_ids=(70,)),
        "stop-str": request("stop-str", [1, 2], 3, stop=("CD",)),
        "length": request("length", [1, 2], 4, max_tokens=3),
    }
    for r in reqs.values():
        scheduler.add(r)
    step(scheduler, {"eos": EOS, "ignore": EOS, "stop-id": 70, "stop-str": ord("A")})
    assert (reqs["eos"].finish_reason, reqs["stop-id"].finish_reason) == ("stop", "stop")
    assert not reqs["ignore"].is_finished  # EOS ignored
    step(scheduler, {"ignore": EOS, "stop-str": ord("C")})
    step(scheduler, {"stop-str": ord("D")})
    assert (reqs["ignore"].finish_reason, reqs["ignore"].num_output_tokens) == ("length", 2)
    assert reqs["stop-str"].finish_reason == "stop"
    assert reqs["stop-str"].detokenizer.text == "A"  # the stop string is cut off
    assert (reqs["length"].finish_reason, reqs["length"].num_output_tokens) == ("length", 3)
    assert not scheduler.has_work or not scheduler.running


def test_abort_frees_blocks_and_tells_the_workers():
    scheduler = make_scheduler(budget=64)
    idle = scheduler.coordinator.num_free_blocks
    scheduler.add(request("gone", list(range(9)), 0, max_tokens=50))
    step(scheduler)
    assert scheduler.coordinator.num_free_blocks < idle
    scheduler.abort("gone")
    assert scheduler.coordinator.num_free_blocks == idle
    assert scheduler.schedule().plan.finished_ids == ["gone"]
    assert scheduler.abort("gone") is None


def test_detokenizing_never_rereads_an_unbounded_window():
    """A run of bytes that never completes a character (a random model emits such runs) is
    released as replacement characters, and each step decodes a bounded window."""
    windows = []

    class CountingTokenizer(ByteTokenizer):
        def decode(self, token_ids):
            windows.append(len(token_ids))
            return super().decode(token_ids)

    detokenizer = IncrementalDetokenizer(CountingTokenizer())
    text = "".join(detokenizer.add([0x80]) for _ in range(1000))
    assert max(windows) <= CONTEXT_TOKENS + MAX_HELD_TOKENS
    assert len(text) >= 1000 - MAX_HELD_TOKENS and set(text) == {"\ufffd"}
    assert detokenizer.add(list("é".encode())) + detokenizer.flush() == "é"


def test_a_step_planned_ahead_counts_the_running_steps_samples():
    """Asynchronous scheduling: step B is planned while step A runs. B decodes the token A
    samples (known to the workers by then); a request A ends by length is left out; answers
    applied in order give the tokens a step-by-step run gives, and every block comes back."""
    scheduler = make_scheduler(budget=64)
    idle = scheduler.coordinator.num_free_blocks
    long = request("long", [1, 2, 3, 4, 5], 0, max_tokens=3)
    scheduler.add(long)
    scheduler.add(request("short", [9, 9], 1, max_tokens=1))
    step_a = scheduler.schedule()
    step_b = scheduler.schedule(ahead=True)
    assert [(r.request_id, n) for r, n in step_b.scheduled] == [("long", 1)]  # short is done
    (delta,) = step_b.plan.deltas
    assert (delta.num_computed_tokens, delta.num_new_tokens) == (5, 1)
    answer(scheduler, step_a, StepResult(sampled={"long": 70, "short": 71}))
    assert long.kv.token_ids == [1, 2, 3, 4, 5, 70]
    assert "short" not in scheduler.requests  # finished by length: max_tokens 1
    step_c = scheduler.schedule(ahead=True)  # B still runs
    answer(scheduler, step_b, StepResult(sampled={"long": 72}))
    answer(scheduler, step_c, StepResult(sampled={"long": 74}))
    assert (long.output_token_ids, long.finish_reason) == ([70, 72, 74], "length")
    assert scheduler.coordinator.num_free_blocks == idle


def test_planning_ahead_never_preempts():
    scheduler = make_scheduler(num_blocks=7, budget=64, max_model_len=24)
    scheduler.add(request("a", list(range(11)), 0, max_tokens=12))  # 3 of 6 usable blocks
    scheduler.add(request("b", list(range(50, 61)), 1, max_tokens=12))  # the other 3
    step(scheduler)
    running = scheduler.schedule()  # both decode their 12th token: their blocks' last slots
    assert len(running.scheduled) == 2
    ahead = scheduler.schedule(ahead=True)
    assert ahead.is_empty and scheduler.num_preemptions == 0
    answer(scheduler, running, StepResult(sampled={"a": 1, "b": 2}))
    assert scheduler.schedule().plan.preempted_ids == ["b"]  # now it may preempt


def test_through_pipeline_stages_each_step_in_flight_takes_its_share_of_requests():
    """Two micro-batches: the requests split between the steps in flight; a step planned
    while both run finds nothing it may take; once one answers, its requests go on."""
    scheduler = make_scheduler(budget=64, micro_batches=2)
    for index in range(4):
        scheduler.add(request(f"r{index}", [1, 2, 3], index))
    step_a = scheduler.schedule()
    step_b = scheduler.schedule(ahead=True)
    assert [r.request_id for r, _ in step_a.scheduled] == ["r0", "r1"]
    assert [r.request_id for r, _ in step_b.scheduled] == ["r2", "r3"]
    assert scheduler.schedule(ahead=True).is_empty  # every request's token is owed
    answer(scheduler, step_a, StepResult(sampled={"r0": 70, "r1": 71}))
    step_c = scheduler.schedule(ahead=True)  # B still runs
    assert [(r.request_id, n) for r, n in step_c.scheduled] == [("r0", 1), ("r1", 1)]


SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'


@pytest.mark.parametrize(
    ("settings", "steps"),
    [
        ({}, 2),  # one stage: the next step planned while one runs
        ({"pipeline_parallel_size": 2}, 2),  # one per stage
        ({"pipeline_parallel_size": 3}, 3),
        ({"pipeline_parallel_size": 2, "pp_micro_batches": 1}, 1),
        ({"speculative_config": SPECULATIVE}, 1),  # a verifying step's tokens are unknown
    ],
)
def test_the_engine_settings_give_the_steps_in_flight(settings, steps):
    scheduler = build_scheduler(
        EngineConfig(**settings), model_config_for("embedded:tiny"), kv_config()
    )
    assert scheduler.max_steps_in_flight == steps
