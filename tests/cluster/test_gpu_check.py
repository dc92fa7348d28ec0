"""The GPU check command runs end to end, CPU-sized (``--smoke``), and prints its table: the
command a GPU session runs must not be the first time it runs."""

from __future__ import annotations

import json
import subprocess
import sys


def test_gpu_check_smoke_prints_one_table(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cluster.bench.gpu_check", "--smoke", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kvray GPU check: ")
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = {p["name"]: p for p in summary["parts"]}
    assert list(parts) == ["gpu tests", "attention", "throughput"]
    assert all(p["status"] == "passed" for p in parts.values())
    assert "of copy bandwidth" in parts["attention"]["figures"]
    assert "kvray (ray, TP 1)" in parts["throughput"]["figures"]
    assert "transformers" in parts["throughput"]["figures"]
    assert all((tmp_path / f"{name}.log").exists() for name in parts)
