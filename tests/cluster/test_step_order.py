"""The engine loop sends the next step before it streams the last one's tokens
(``AsyncEngine._finish_step``): with drafts, where only one step is ever in flight, the workers
would otherwise sit idle while every client hears of its tokens. The real in-process engine,
worker and gRPC server; the transport and the delivery are only counted."""

from __future__ import annotations

import json

from cluster.client import Client
from cluster.config import EngineConfig
from cluster.local import LocalServer

SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
)


def test_with_drafts_the_next_step_goes_out_before_this_ones_tokens_are_streamed():
    config = EngineConfig(
        kv_cache_memory_bytes=8 << 20, port=0, max_model_len=256, speculative_config=SPEC
    )
    with LocalServer(config) as server:
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
