"""Prometheus text of several engine replicas as one: every sample again with a ``replica``
label, then the totals (counters, gauges and histogram buckets summed over the replicas,
under the same labels without ``replica``), so dashboards written for one engine read the
totals and a per-replica panel needs only the new label."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families


def merge_metrics(texts: dict[str, str]) -> str:
    """``texts``: replica id -> that replica's /metrics text."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
    per_replica: dict[str, list[str]] = defaultdict(list)  # family -> sample lines
    totals: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            for sample in family.samples:
                labels = dict(sample.labels)
                labelled = {**labels, "replica": replica}
                per_replica[family.name].append(_line(sample.name, labelled, sample.value))
                totals[family.name][(sample.name, tuple(sorted(labels.items())))] += sample.value
    lines = []
    for name, (kind, documentation) in families.items():
        exposed = f"{name}_total" if kind == "counter" else name  # as prometheus_client writes
        lines += [f"# HELP {exposed} {documentation}", f"# TYPE {exposed} {kind}"]
        lines += per_replica[name]
        for (sample_name, labels), value in totals[name].items():
            lines.append(_line(sample_name, dict(labels), value))
    return "\n".join(lines) + "\n" if lines else ""


def _line(name: str, labels: dict[str, str], value: float) -> str:
    escaped = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{escaped}}} {value!r}" if escaped else f"{name} {value!r}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
