"""``ray job submit`` of a kvray entrypoint against a ``ray start --head`` cluster, with Ray's
token authentication on (the submitting shell sets RAY_AUTH_MODE=token, as the README says)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from workers.parallel import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def ray_head(env: dict, num_cpus: int = 2):
    """A ``ray start --head --block`` this test owns: stopping it stops only the processes it
    started (``ray stop`` would kill every Ray on the machine). Its own temp dir keeps its
    address out of /tmp/ray/ray_current_cluster, where a later ``ray.init()`` would find it
    and connect to a dead cluster. Yields the dashboard port."""
    gcs, dashboard = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvray-ray-", dir="/tmp")  # short: socket paths
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--num-cpus", str(num_cpus), "--port", str(gcs),
         "--dashboard-port", str(dashboard), "--disable-usage-stats", "--temp-dir", temp_dir],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in head.stdout:
            seen.append(line)
            if "Ray runtime started" in line:
                started.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert started.wait(timeout=180), "ray start failed:\n" + "".join(seen)
        yield dashboard
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_kvray(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "token"}
    with ray_head(env) as dashboard:
        for _ in range(3):  # the job agent can lag `ray start` by a moment: it says so
            result = submit(dashboard, env)
            if "No available agent to submit job" not in result.stderr:
                break
            time.sleep(5)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith('{"request_id"'))
    completion = json.loads(line)
    assert len(completion["token_ids"]) == 6
    assert "succeeded" in result.stdout


def submit(dashboard: int, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
         "--working-dir", str(ROOT), "--",
         "kvray", "generate", "--prompt", "Hello from a Ray job", "--max-tokens", "6",
         "--temperature", "0", "--output", "json", "-tp", "2", "--kv-cache-memory", "16MiB",
         "--max-model-len", "256", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
