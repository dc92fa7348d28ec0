"""Prometheus metrics of one engine, under vLLM's names with a ``kvray:`` prefix and a
``model_name`` label, so dashboards and autoscaling rules written for vLLM read them with the
prefix swapped. The engine records; the HTTP server's ``/metrics`` exports.

Each engine has its own registry (several engines can share a test process).
"""

from __future__ import annotations

import copy
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from cluster.scheduler.scheduler import SpeculationStats

disable_created_metrics()  # the *_created series vLLM does not export either

# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def gauge(name, text):
            return Gauge(f"kvray:{name}", text, label, registry=self.registry).labels(model_name)

        def counter(name, text):
            return Counter(f"kvray:{name}", text, label, registry=self.registry).labels(model_name)

        def histogram(name, text, buckets):
            return Histogram(
                f"kvray:{name}", text, label, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of KV blocks in use (1 = all)")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found there")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.num_preemptions = counter("num_preemptions", "Requests preempted")
        self._success = Counter(
            "kvray:request_success",
            "Requests finished, by reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From arrival to the first token", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between a request's tokens", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From arrival to the end", E2E_BUCKETS
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Decode steps of a request that carried drafts"
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens sent for verification"
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self._accepted_per_pos = Counter(
            "kvray:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their depth in the draft (0: the first)",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._preemptions_seen = 0
        self._speculation_seen = SpeculationStats()

    def observe_step(self, scheduler) -> None:
        """Gauges and the preemption counter, after each step."""
        coordinator = scheduler.coordinator
        self.num_requests_running.set(len(scheduler.running))
        self.num_requests_waiting.set(len(scheduler.waiting))
        usable = max(coordinator.block_pool.num_blocks - 1, 1)  # block 0 is the null block
        self.kv_cache_usage.set(1.0 - coordinator.num_free_blocks / usable)
        if scheduler.num_preemptions > self._preemptions_seen:
            self.num_preemptions.inc(scheduler.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.num_preemptions
        self._observe_speculation(scheduler.speculation)

    def _observe_speculation(self, now: SpeculationStats) -> None:
        seen = self._speculation_seen
        if now.num_drafts == seen.num_drafts:
            return
        self.spec_decode_num_drafts.inc(now.num_drafts - seen.num_drafts)
        self.spec_decode_num_draft_tokens.inc(now.num_draft_tokens - seen.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(now.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.accepted_per_position
        for position, count in enumerate(now.accepted_per_position):
            previous = before[position] if position < len(before) else 0
            if count > previous:
                self._accepted_per_pos.labels(self.model_name, str(position)).inc(count - previous)
        self._speculation_seen = copy.deepcopy(now)

    def observe_tokens(self, request, num_tokens: int) -> None:
        """``num_tokens`` new tokens of ``request`` arrived now."""
        now = time.monotonic()
        if request.last_token_time is None:
            self.time_to_first_token.observe(now - request.arrival_time)
            self.prompt_tokens.inc(request.num_prompt_tokens)
            self.prefix_cache_queries.inc(request.num_prompt_tokens)
            self.prefix_cache_hits.inc(request.num_cached_prompt_tokens)
        else:
            self.inter_token_latency.observe((now - request.last_token_time) / max(num_tokens, 1))
        request.last_token_time = now
        self.generation_tokens.inc(num_tokens)

    def observe_finish(self, request) -> None:
        self._success.labels(self.model_name, request.finish_reason or "abort").inc()
        self.e2e_request_latency.observe(time.monotonic() - request.arrival_time)

    def rebased(self, scheduler) -> None:
        """A new scheduler (after a rebuild) counts preemptions and drafts from zero again."""
        self._preemptions_seen = scheduler.num_preemptions
        self._speculation_seen = copy.deepcopy(scheduler.speculation)

    def render(self) -> bytes:
        return generate_latest(self.registry)
