"""The engine loop sends the next step before it streams the last one's tokens
(``AsyncEngine._finish_step``): with drafts, where only one step is ever in flight, the workers
would otherwise sit idle while every client hears of its tokens. A request whose output could
not be processed ends before that next step is planned, which then never carries it. The real
in-process engine, worker and gRPC server; the transport and the delivery are only counted."""

from __future__ import annotations

import json

import pytest

from cluster.client import Client, KVRayError
from cluster.config import EngineConfig
from cluster.local import LocalServer

SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
)


CONFIG = EngineConfig(
    kv_cache_memory_bytes=8 << 20, port=0, max_model_len=256, speculative_config=SPEC
)


def test_with_drafts_the_next_step_goes_out_before_this_ones_tokens_are_streamed():
    with LocalServer(CONFIG) as server:
        engine = server.engine
        assert engine.scheduler.max_steps_in_flight == 1
        sends, deliveries = [0], []
        execute, deliver = engine.transport.execute, engine._deliver

        def counted_execute(plan):
            sends[0] += 1
            return execute(plan)

        def counted_deliver(request):
            # Steps sent so far, steps answered, and whether more steps follow.
            deliveries.append((sends[0], engine.num_steps, not request.is_finished))
            deliver(request)

        engine.transport.execute, engine._deliver = counted_execute, counted_deliver
        with Client(server.address) as client:
            done = client.generate("one two one two one two", max_tokens=24, ignore_eos=True)
        assert len(done.token_ids) == 24
    going_on = [(sent, answered) for sent, answered, more in deliveries if more]
    assert len(going_on) >= 5
    assert all(sent == answered + 1 for sent, answered in going_on)


def test_a_request_whose_output_fails_is_not_in_the_step_after():
    with LocalServer(CONFIG) as server:
        engine, plans, doomed = server.engine, [], []
        execute, prepare = engine.transport.execute, engine.prepare

        def recorded_execute(plan):
            plans.append(plan)
            return execute(plan)

        async def failing_prepare(*args, **kwargs):
            request = await prepare(*args, **kwargs)
            if not doomed:  # the first request's detokenizer fails on its first token
                doomed.append(request.request_id)
                request.detokenizer.add = lambda token_ids: 1 / 0
            return request

        engine.transport.execute, engine.prepare = recorded_execute, failing_prepare
        with Client(server.address) as client:
            with pytest.raises(KVRayError, match="Processing this request failed"):
                client.generate("doomed", max_tokens=8)
            assert len(client.generate("after it", max_tokens=4).token_ids) == 4
    assert any(r.request_id == doomed[0] for r in plans[0].new_requests)
    assert not any(d.request_id == doomed[0] for plan in plans for d in plan.deltas)
    assert any(doomed[0] in plan.finished_ids for plan in plans)
