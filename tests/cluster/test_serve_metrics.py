"""/metrics of several replicas as one: every replica's samples with its ``replica`` label,
and totals under the original labels, for counters, gauges and histograms alike; the merged
text parses as Prometheus text again."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.serve.metrics import merge_metrics


def replica_text(generated: int, running: int, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    labels = {"model_name": "m"}
    Counter("kvray:generation_tokens", "tokens", ["model_name"], registry=registry).labels(
        **labels
    ).inc(generated)
    Gauge("kvray:num_requests_running", "running", ["model_name"], registry=registry).labels(
        **labels
    ).set(running)
    histogram = Histogram(
        "kvray:e2e_request_latency_seconds", "e2e", ["model_name"], buckets=(1, 10),
        registry=registry,
    )  # fmt: skip
    for latency in latencies:
        histogram.labels(**labels).observe(latency)
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_replica_is_labelled_and_the_totals_are_sums():
    merged = samples(
        merge_metrics({"r1": replica_text(5, 2, [0.5, 3]), "r2": replica_text(7, 1, [20])})
    )
    model = ("model_name", "m")

    def value(name, replica=None, **labels):
        key = sorted([model, *labels.items(), *([("replica", replica)] if replica else [])])
        return merged[(name, tuple(key))]

    assert value("kvray:generation_tokens_total", "r1") == 5
    assert value("kvray:generation_tokens_total", "r2") == 7
    assert value("kvray:generation_tokens_total") == 12
    assert value("kvray:num_requests_running") == 3
    assert value("kvray:e2e_request_latency_seconds_bucket", le="1.0") == 1
    assert value("kvray:e2e_request_latency_seconds_bucket", le="10.0") == 2
    assert value("kvray:e2e_request_latency_seconds_bucket", "r2", le="+Inf") == 1
    assert value("kvray:e2e_request_latency_seconds_count") == 3
    assert value("kvray:e2e_request_latency_seconds_sum") == 23.5


def test_no_replica_reported_is_empty_text():
    assert merge_metrics({}) == ""
    assert merge_metrics({"r1": ""}) == ""
