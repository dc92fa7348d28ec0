"""Speculative decoding on the controller: ``--speculative-config`` parsing, the n-gram
proposer, and the scheduler's part (drafts within budget and length, computed counts rolled
back to what was accepted, stops inside accepted drafts, no drafts where they cannot be
verified), driven against a real coordinator with the workers' answers written by hand."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.speculative.ngram import NgramProposer
from tests.cluster.test_scheduler import EOS, answer, make_scheduler, request
from workers.protocol import StepResult
from workers.speculative_config import parse_speculative_config
from workers.structured_outputs import StructuredOutputs


def ngram(k=3, low=1, high=3) -> NgramProposer:
    return NgramProposer(
        parse_speculative_config(
            f'{{"method": "ngram", "num_speculative_tokens": {k}, '
            f'"prompt_lookup_min": {low}, "prompt_lookup_max": {high}}}'
        )
    )


# -- the config ------------------------------------------------------------------------------


def test_lookup_bounds_default_to_each_other_and_to_five():
    parse = parse_speculative_config
    assert parse('{"method": "ngram", "num_speculative_tokens": 2}').lookup_range == (5, 5)
    text = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    assert parse(text).lookup_range == (3, 3)
    text = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}'
    assert parse(text).lookup_range == (2, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ngram", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "needs a draft model.*ngram"),
        ('{"method": "lookahead", "num_speculative_tokens": 2}', "unknown method 'lookahead'"),
        ('{"method": "ngram"}', "missing required field `num_speculative_tokens`"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"in \[1, 16\], got 0"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown field"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "1 <= min <= max, got min 4, max 2",
        ),
    ],
)
def test_bad_configs_are_refused_with_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=text)  # the flag is checked where settings are made


# -- the proposer ----------------------------------------------------------------------------


def test_the_longest_match_wins_and_the_newest_among_equals():
    proposer = ngram(k=2, low=1, high=3)
    # "7 8" ends the sequence; "6 7 8" matches at the start (3 tokens), "7 8" later (2).
    assert proposer.propose([6, 7, 8, 1, 2, 5, 7, 8, 3, 4, 6, 7, 8], 5) == [1, 2]
    # Two matches of the longest length: the newer one's continuation.
    assert proposer.propose([7, 8, 1, 7, 8, 2, 7, 8], 5) == [2, 7]


def test_no_drafts_below_the_shortest_match_or_beyond_the_limits():
    assert ngram(low=2, high=3).propose([1, 2, 3, 9, 2, 3, 5, 3], 5) == []  # "5 3" unseen
    assert ngram(low=1, high=3).propose([1, 2, 3, 9, 2, 3, 5, 3], 5) == [5, 3]
    assert ngram(k=3).propose([1, 2, 3, 4, 1, 2], 1) == [3]  # max_drafts caps it
    assert ngram(k=2).propose([1, 2, 3, 4, 1, 2], 9) == [3, 4]
    assert ngram().propose([1], 3) == [] and ngram().propose([1, 2, 3], 0) == []


# -- the scheduler ---------------------------------------------------------------------------


def speculating(budget=64, **kwargs):
    scheduler = make_scheduler(budget=budget, **kwargs)
    scheduler.proposer = ngram(k=3, low=1, high=2)
    return scheduler


def prefill(scheduler, req, token):
    scheduler.add(req)
    scheduled = scheduler.schedule()
    answer(scheduler, scheduled, StepResult(sampled={req.request_id: token}))


def test_a_decode_carries_drafts_and_falls_back_to_what_was_accepted():
    scheduler = speculating()
    assert not scheduler.schedules_ahead
    req = request("r", [1, 2, 3, 4, 5, 6, 1, 2], max_tokens=20)
    prefill(scheduler, req, 3)  # tokens: ... 1 2 3: "2 3" was followed by 4 5 6
    scheduled = scheduler.schedule()
    (delta,) = scheduled.plan.deltas
    assert delta.draft_token_ids == [4, 5, 6]
    assert (delta.num_computed_tokens, delta.num_new_tokens) == (8, 4)
    # One draft accepted, then the model says 9 where the draft said 5.
    answer(scheduler, scheduled, StepResult(sampled={"r": 9}, num_accepted={"r": 1}))
    assert req.kv.token_ids[8:] == [3, 4, 9]
    assert req.kv.num_computed_tokens == 10  # ... up to 4; 9 is computed next step
    assert req.pending_token_ids[-2:] == [4, 9]
    stats = scheduler.speculation
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.accepted_per_position == [1, 0, 0]
    # Blocks are cached only up to the verified tokens: 10 computed -> two full blocks.
    assert len(scheduler.coordinator.find_longest_cache_hit(req.kv).block_ids[0]) <= 2
    # "4 9" was never seen: a plain decode step, whose 1 was followed by 2 3 4 before.
    scheduled = scheduler.schedule()
    assert scheduled.plan.deltas[0].draft_token_ids == []
    answer(scheduler, scheduled, StepResult(sampled={"r": 1}))
    # Every draft accepted: the computed count keeps all of them.
    scheduled = scheduler.schedule()
    assert scheduled.plan.deltas[0].draft_token_ids == [2, 3, 4]
    answer(scheduler, scheduled, StepResult(sampled={"r": 7}, num_accepted={"r": 3}))
    assert req.kv.num_computed_tokens == 15
    assert req.kv.token_ids[11:] == [1, 2, 3, 4, 7]
    assert scheduler.speculation.accepted_per_position == [2, 1, 1]


def test_drafts_fit_the_budget_and_max_tokens():
    scheduler = speculating(budget=3)
    req = request("r", [1, 2], max_tokens=20)
    prefill(scheduler, req, 1)  # [1 2 1]: "1" was followed by 2, 1
    assert scheduler.schedule().plan.deltas[0].draft_token_ids == [2, 1]  # 1 + 2 = budget
    scheduler = speculating()
    req = request("r", [1, 2, 3, 4, 1], max_tokens=3)
    prefill(scheduler, req, 2)  # one output; two more at most, so one draft
    assert scheduler.schedule().plan.deltas[0].draft_token_ids == [3]


def test_stops_inside_accepted_drafts_drop_what_follows():
    scheduler = speculating()
    req = request("r", [1, 2, 3, EOS, 5, 1, 2], max_tokens=20)
    prefill(scheduler, req, 3)
    scheduled = scheduler.schedule()
    assert scheduled.plan.deltas[0].draft_token_ids == [EOS, 5, 1]
    answer(scheduler, scheduled, StepResult(sampled={"r": 8}, num_accepted={"r": 3}))
    assert req.finish_reason == "stop"
    assert req.output_token_ids == [3, EOS]
    assert req.pending_token_ids == [3, EOS]
    # A stop string inside the drafts cuts the text there too.
    scheduler = speculating()
    req = request("s", [ord(c) for c in "xABCDxA"], max_tokens=20, stop=("BC",))
    prefill(scheduler, req, ord("B"))  # "...xAB"
    scheduled = scheduler.schedule()
    assert scheduled.plan.deltas[0].draft_token_ids == [ord("C"), ord("D"), ord("x")]
    answer(scheduler, scheduled, StepResult(sampled={"s": 65}, num_accepted={"s": 3}))
    assert req.finish_reason == "stop"
    assert req.output_token_ids == [ord("B"), ord("C")]


def test_no_drafts_for_constrained_requests_or_logprobs():
    scheduler = speculating()
    json_out = StructuredOutputs(json_object=True)
    for index, kwargs in enumerate([{"logprobs": 1}, {"structured_outputs": json_out}]):
        req = request(f"r{index}", [1, 2, 3, 1, 2], index, max_tokens=20, **kwargs)
        prefill(scheduler, req, 3)
        assert scheduler.schedule().plan.deltas[0].draft_token_ids == []
        scheduler.abort(req.request_id)
