"""``kvray batch``: results in input order, resume from a partial output, bad lines reported
with their line numbers without stopping the others; on a TP=2 engine on Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray

from cluster.batch import run_batch
from cluster.client import Client
from tests.cluster.ray_helpers import serve, stop

LINES = [
    {"prompt": "first", "max_tokens": 5, "temperature": 0, "id": "a"},
    {"prompt_token_ids": [72, 101, 108, 108, 111], "max_tokens": 3, "temperature": 0},
    "this line is not JSON",
    {"prompt": "second", "max_tokens": 0},
    {"prompt": "third", "max_tokens": 7, "temperature": 0, "stop_token_ids": [999]},
    {"prompt": "fourth", "max_tokens": 2, "temperature": 0, "colour": "blue"},
    {"prompt": "a much longer fifth prompt", "max_tokens": 9, "temperature": 0},
]


@pytest.fixture(scope="module")
def tp2_server():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    handle, address = serve(tensor_parallel_size=2)
    yield address
    stop(handle)
    ray.shutdown()


def write_input(path):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")
    return path


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_results_keep_input_order_and_report_bad_lines(tp2_server, tmp_path, capsys):
    summary = run_batch(tp2_server, write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl")
    assert (summary.num_lines, summary.num_succeeded, summary.num_failed) == (7, 3, 4)
    results = read(tmp_path / "out.jsonl")
    assert [r["line"] for r in results] == [1, 2, 3, 4, 5, 6, 7]
    assert [len(r.get("token_ids", [])) for r in results] == [5, 3, 0, 0, 0, 0, 9]
    assert results[0]["id"] == "a" and results[0]["finish_reason"] == "length"
    assert results[2]["error"].startswith("line 3: not JSON")
    assert "line 4" in results[3]["error"] and "max_tokens" in results[3]["error"]
    # A stop token the model's vocabulary of 258 cannot hold is refused by name.
    assert "line 5" in results[4]["error"] and "stop_token_ids[0]" in results[4]["error"]
    assert "line 6: unknown field(s) ['colour']" in results[5]["error"]
    stderr = capsys.readouterr().err
    assert "line 3" in stderr and "line 4" in stderr and "line 6" in stderr
    with Client(tp2_server) as client:  # the same tokens as asking one at a time
        alone = client.generate("a much longer fifth prompt", max_tokens=9, temperature=0)
    assert results[6]["token_ids"] == alone.token_ids
    assert results[6]["usage"]["completion_tokens"] == 9


def test_resume_after_a_partial_output(tp2_server, tmp_path):
    source = write_input(tmp_path / "in.jsonl")
    output = tmp_path / "out.jsonl"
    done_before = {
        "line": 1,
        "id": "a",
        "text": "KEPT",
        "token_ids": [1],
        "finish_reason": "x",
        "usage": {},
    }
    output.write_text(json.dumps(done_before) + "\n" + '{"line": 2, "te')  # torn second line
    summary = run_batch(tp2_server, source, output)
    assert summary.num_skipped == 1
    results = read(output)
    assert results[0] == done_before  # not recomputed
    assert [r["line"] for r in results] == [1, 2, 3, 4, 5, 6, 7]
    assert len(results[1]["token_ids"]) == 3


def test_kvray_batch_command(tmp_path):
    source = write_input(tmp_path / "in.jsonl")
    output = tmp_path / "out.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "batch",
            "--input",
            str(source),
            "--output",
            str(output),
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
            "--log-level",
            "WARNING",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "3 succeeded, 4 failed, 0 already done" in result.stderr
    assert [r["line"] for r in read(output)] == [1, 2, 3, 4, 5, 6, 7]
