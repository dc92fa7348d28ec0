"""The ``kvray`` command as a user runs it: subprocesses, real output, real exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.client import Client, UnavailableError

KVRAY = [sys.executable, "-m", "cluster.cli"]
SMALL = ["--kv-cache-memory", "16MiB", "--max-model-len", "256", "--log-level", "WARNING"]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*KVRAY, *args], capture_output=True, text=True, timeout=timeout)


def test_plan_prints_groups_strides_and_capacity():
    result = run("plan", "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "blocks: 1024 x 65536 bytes" in out
    assert "fits: 16384 tokens, max concurrency 16.00x at 1024 tokens" in out
    assert "FullAttentionSpec: 4 layers, block 16 tokens, page 16384 bytes" in out
    for layout in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        assert f"  {layout}: 4 layers (" in out
    assert "BLHNC: 4 layers (16384, 65536, 0)" in out


def test_plan_for_a_checkpoint_at_tp2(tmp_path):
    from tests.workers.hf_models import save_model

    model_dir = save_model("qwen3-sliding", tmp_path)
    result = run(
        "plan",
        "--model",
        str(model_dir),
        "-tp",
        "2",
        "--kv-cache-memory",
        "1MiB",
        "--max-model-len",
        "128",
        "--block-size",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert "Qwen3ForCausalLM), TP 2" in result.stdout
    assert "SlidingWindowSpec: 2 layers, block 4 tokens, page 512 bytes (H=1 N=4 C=128, " in (
        result.stdout
    )
    assert "fits: 2016 tokens, max concurrency 15.75x at 128 tokens" in result.stdout
    sizes = ["--kv-cache-memory", "1MiB", "--max-model-len", "128", "--block-size", "4"]
    half = run("plan", "--model", str(model_dir), "-tp", "2", *sizes, "--kv-cache-dtype", "float16")
    assert half.returncode == 0, half.stderr
    assert "page 256 bytes (H=1 N=4 C=64, float16)" in half.stdout
    assert "blocks: 2048 x 512 bytes" in half.stdout  # float32's 1024, twice over
    assert "fits: 4032 tokens" in half.stdout
    refused = run("plan", "--kv-cache-dtype", "fp8")
    assert refused.returncode != 0 and "invalid choice: 'fp8'" in refused.stderr


def test_generate_on_a_local_ray_prints_json_with_token_ids():
    result = run(
        "generate",
        "--prompt",
        "Hello",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--output",
        "json",
        *SMALL,
    )
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    assert len(completion["token_ids"]) == 6
    assert completion["finish_reason"] == "length"
    assert completion["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "cached_prompt_tokens": 0,
    }
    text = run(
        "generate",
        "--in-process",
        "--prompt-token-ids",
        "72,101,108",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        *SMALL,
    )
    assert text.returncode == 0 and len(text.stdout.strip()) > 0


def test_generate_with_a_constraint(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, '
                      '"required": ["n"], "additionalProperties": false}')  # fmt: skip
    result = run("generate", "--in-process", "--prompt", "x", "--max-tokens", "24",
                 "--temperature", "1", "--json-schema", f"@{schema}", "--output", "json",
                 *SMALL)  # fmt: skip
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    if completion["finish_reason"] == "stop":
        assert set(json.loads(completion["text"])) == {"n"}
    else:  # a random model may write a long number: what came is still the object's start
        assert completion["text"].startswith('{"n": ')


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-layout", "XYZ"], "Unknown KV cache layout 'XYZ'"),
        (["--kv-cache-memory", "lots"], "not a size"),
        (["--attention-backend", "cuda-magic"], "Unknown attention backend"),
    ],
)
def test_bad_settings_fail_with_a_message(args, message):
    result = run("generate", "--in-process", "--prompt", "x", *SMALL, *args)
    assert result.returncode == 2
    assert message in result.stderr


def start_serving(*flags: str) -> tuple[subprocess.Popen, str, str, list[str]]:
    """``kvray serve`` on a fresh local Ray; returns the process, its gRPC address, the base
    URL of its OpenAI API and the list its output lines keep landing in (read in a thread, so
    the pipe never fills)."""
    server = subprocess.Popen(
        [*KVRAY, "serve", "--port", "0", "--http-port", "0", *SMALL, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},  # a fresh local Ray
    )
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in server.stdout:
            seen.append(line)
            if line.startswith("kvray: serving"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout=180):
        server.kill()
        raise AssertionError("kvray serve did not report its address:\n" + "".join(seen))
    line = next(x for x in seen if x.startswith("kvray: serving"))
    address = line.split(" on ")[1].split()[0]
    base_url = line.split("OpenAI API at ")[1].split(";")[0]
    return server, address, base_url, seen


def generate_token_ids(model_dir, prompt: list[int], max_tokens: int) -> dict:
    """``kvray generate --in-process`` of a token-id prompt, greedy: its JSON completion."""
    result = run(
        "generate", "--in-process", "--model", str(model_dir),
        "--prompt-token-ids", ",".join(map(str, prompt)), "--max-tokens", str(max_tokens),
        "--temperature", "0", "--output", "json", *SMALL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def serve_twice(model_dir, prompt: list[int], max_tokens: int, *flags: str) -> list:
    """``kvray serve --model DIR`` answering the same greedy request twice (the second may hit
    the prefix cache), then SIGTERM, on which it must exit cleanly."""
    server, address, _, seen = start_serving("--model", str(model_dir), *flags)
    try:
        with Client(address, timeout=120) as client:
            return [client.generate(prompt, max_tokens=max_tokens, temperature=0) for _ in "12"]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, "".join(seen)


def check_openai_api_and_metrics(base_url: str) -> None:
    """The OpenAI API of the same server, through the official client; /metrics counts it."""
    api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    completion = api.completions.create(
        model=api.models.list().data[0].id, prompt="Hello", max_tokens=4, temperature=0
    )
    assert completion.usage.completion_tokens == 4
    assert completion.choices[0].finish_reason == "length"
    metrics = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    (success,) = [
        sample
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "kvray:request_success_total"
    ]
    assert success.labels["finished_reason"] == "length" and success.value == 1


def check_drain_finishes_streams_and_refuses_new_ones(server, address: str) -> None:
    """SIGTERM with streams in flight: they finish; new requests are refused meanwhile."""
    finished, started = [], threading.Barrier(4)

    def stream(index: int) -> None:
        with Client(address, timeout=120) as client:
            deltas = client.stream(f"stream {index}", max_tokens=150, ignore_eos=True)
            first = next(deltas)
            started.wait()
            rest = list(deltas)
            finished.append((sum(len(d.token_ids) for d in [first, *rest]), rest[-1]))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)
    server.send_signal(signal.SIGTERM)
    with Client(address, timeout=30) as client:
        deadline = time.monotonic() + 20
        while client.health() != "NOT_SERVING":
            assert time.monotonic() < deadline, "health stayed SERVING while draining"
            time.sleep(0.05)
        with pytest.raises(UnavailableError, match="shutting down"):
            client.generate("too late", max_tokens=2)
    for thread in threads:
        thread.join(timeout=120)
    assert [(n, last.finish_reason) for n, last in finished] == [(150, "length")] * 3


def test_serve_generate_then_drain_on_sigterm():
    server, address, base_url, seen = start_serving("-tp", "2", "--drain-timeout", "60")
    try:
        check_openai_api_and_metrics(base_url)
        result = run(
            "generate", "--server", address, "--prompt", "Hello", "--max-tokens", "5",
            "--temperature", "0", "--output", "json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)["token_ids"]) == 5
        check_drain_finishes_streams_and_refuses_new_ones(server, address)
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, "".join(seen)
    assert any("draining" in line for line in seen)


def test_serve_two_replicas_on_two_cpus_and_two_sigterms_drain_once():
    """``kvray serve -dp 2`` on this 2-CPU machine: only the two worker bundles reserve CPUs;
    both APIs answer; a second SIGTERM during the first's handling (a supervisor and the
    kubelet both signalling) neither hangs nor cuts the drain short."""
    server, address, base_url, seen = start_serving("-dp", "2", "--cpus-per-worker", "1")
    try:
        assert "with 2 replica(s) on Ray Serve (TP 1 each, kv-aware routing)" in seen[-1]
        api = openai.OpenAI(base_url=base_url.strip(), api_key="unused", max_retries=0)
        completion = api.completions.create(  # sampled: without ignore_eos, EOS may end it
            model="embedded:tiny", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert completion.usage.completion_tokens == 4
        with Client(address, timeout=60) as client:
            assert len(client.generate([1, 2, 3], max_tokens=3).token_ids) == 3
            assert client.info()["data_parallel_size"] == 2
            deadline = time.monotonic() + 10  # the replicas report every half second
            while sum(r["num_requests_finished"] for r in client.info()["replicas"]) < 2:
                assert time.monotonic() < deadline, client.info()
                time.sleep(0.1)
        server.send_signal(signal.SIGTERM)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, "".join(seen)
    finally:
        if server.poll() is None:
            server.kill()
    assert sum("draining" in line for line in seen) == 1, "".join(seen)


def test_errors_are_one_line_without_a_traceback():
    result = run("generate", "--model", "/nonexistent", "--prompt", "hi", timeout=120)
    assert result.returncode == 2
    assert "kvray generate: error: No config.json in model directory /nonexistent" in result.stderr
    assert "Traceback" not in result.stderr
