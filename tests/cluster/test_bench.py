"""``kvray bench``: the three modes run end to end at tiny sizes; the fields exist and are
sane (these are not timing tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.bench.report import format_table
from cluster.bench.workload import (
    multi_tenant_requests,
    parse_range,
    random_requests,
    shared_prefix_requests,
)
from cluster.config import EngineConfig
from cluster.local import LocalServer
from workers.model_source import model_config_for

SMALL = ["--kv-cache-memory", "16MiB", "--max-model-len", "256", "--log-level", "WARNING"]
SERVER = EngineConfig(kv_cache_memory_bytes=16 << 20, port=0, max_model_len=256)  # SMALL's


def bench(*args: str, tmp_path) -> dict:
    output = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", *args, "--output-json", str(output)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"kvray bench {args[0]}")
    return json.loads(output.read_text())


def test_throughput_against_transformers(tmp_path):
    report = bench(
        "throughput",
        "--num-prompts",
        "6",
        "--input-len",
        "8-24",
        "--output-len",
        "4-12",
        "--compare",
        "transformers",
        "--hf-batch-size",
        "4",
        *SMALL,
        tmp_path=tmp_path,
    )
    kvray, hf = report["results"]
    # The default path is kvray serve's (Ray); transformers runs sorted batches on this device.
    assert kvray["engine"] == "kvray (ray, TP 1)"
    assert hf["engine"] == "transformers (cpu, sorted batches of 4)"
    assert kvray["requests"] == hf["requests"] == 6
    assert kvray["output_tokens_per_s"] > 0 and hf["output_tokens_per_s"] > 0
    assert kvray["total_tokens_per_s"] > kvray["output_tokens_per_s"]
    assert 0 <= kvray["kv_memory_waste"] < 1
    assert kvray["num_steps"] > 0 and kvray["step_overhead_median_ms"] > 0
    # Every request streams 4+ tokens: a time to the first and a time per later one.
    assert kvray["tpot_ms_median"] > 0 and 0 < kvray["ttft_ms_median"] < kvray["duration_s"] * 1e3
    assert hf["kvray_speedup"] == pytest.approx(
        kvray["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )


def test_prefix_caching_on_and_off(tmp_path):
    report = bench(
        "prefix",
        "--num-prompts",
        "5",
        "--prompt-len",
        "64",
        "--output-len",
        "3",
        "--in-process",
        *SMALL,
        tmp_path=tmp_path,
    )
    rows = {(r["workload"], r["prefix_caching"]): r for r in report["results"]}
    assert set(rows) == {("shared", True), ("shared", False), ("no-hit", True), ("no-hit", False)}
    # 90% of 64 tokens shared: 57, so 3 whole blocks of 16 hit for each of the 4 measured.
    assert rows[("shared", True)]["cached_prompt_tokens"] == 4 * 48
    assert rows[("shared", False)]["cached_prompt_tokens"] == 0
    assert rows[("no-hit", True)]["cached_prompt_tokens"] == 0
    assert all(r["ttft_ms_mean"] > 0 for r in rows.values())


def test_serve_against_a_running_server(tmp_path):
    with LocalServer(SERVER) as server:
        report = bench(
            "serve",
            "--server",
            server.address,
            "--num-prompts",
            "6",
            "--request-rate",
            "50",
            "--input-len",
            "8-24",
            "--output-len",
            "4-12",
            "--log-level",
            "WARNING",
            tmp_path=tmp_path,
        )
        measured = bench(
            "throughput",
            "--server",
            server.address,
            "--num-prompts",
            "4",
            "--input-len",
            "8-24",
            "--output-len",
            "4-12",
            "--log-level",
            "WARNING",
            tmp_path=tmp_path,
        )
    (throughput,) = measured["results"]
    assert throughput["engine"] == f"kvray (server {server.address})"
    assert throughput["requests"] == 4 and throughput["num_steps"] > 0
    (row,) = report["results"]
    assert row["requests"] == 6 and row["request_rate"] == 50
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < row[f"{name}_median"] <= row[f"{name}_p99"]
        assert row[f"{name}_mean"] > 0
    assert row["request_throughput"] > 0
    assert 0 <= row["kv_memory_waste"] < 1


def test_workloads_and_table():
    assert parse_range("32-256") == (32, 256) and parse_range("7") == (7, 7)
    with pytest.raises(ValueError, match="length range"):
        parse_range("9-3")
    requests = random_requests(50, (3, 9), (2, 4), vocab_size=100, seed=1)
    assert requests == random_requests(50, (3, 9), (2, 4), vocab_size=100, seed=1)
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 4 for r in requests)
    shared = shared_prefix_requests(3, 10, 2, 5, vocab_size=100)
    assert shared[0].prompt[:10] == shared[2].prompt[:10]
    table = format_table("t", [{"a": 1, "b": 0.5}, {"a": 22, "c": "x"}])
    assert table.splitlines()[1].split() == ["a", "b", "c"]


def test_serve_multi_tenant_reports_the_cached_share(tmp_path):
    """One request at a time on a cache that holds every system prompt: each tenant's first
    request computes its system prompt, every later one hits all its whole blocks."""
    with LocalServer(SERVER) as server:
        report = bench(
            "serve",
            "--server",
            server.address,
            "--workload",
            "multi-tenant",
            "--num-prompts",
            "10",
            "--num-tenants",
            "3",
            "--system-prompt-len",
            "40",
            "--user-len",
            "4-12",
            "--output-len",
            "2",
            "--max-concurrency",
            "1",
            "--log-level",
            "WARNING",
            tmp_path=tmp_path,
        )
    (row,) = report["results"]
    vocab = model_config_for(SERVER.model).vocab_size
    pairs = multi_tenant_requests(10, 3, 40, (4, 12), (2, 2), vocab_size=vocab)
    assert len({tenant for tenant, _ in pairs}) == 3
    # 40 tokens: two whole blocks of 16 per repeat.
    assert row["cached_prompt_tokens"] == (10 - 3) * 32
    assert row["of_ideal"] == 1.0 and 0 < row["cached_share"] == row["ideal_cached_share"] < 1
    assert row["replicas"] == 1 and row["routing_policy"] == "-"
    assert row["finished_per_replica"] == "10"
