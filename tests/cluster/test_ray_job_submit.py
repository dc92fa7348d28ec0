"""``ray job submit`` of a kvray entrypoint against a ``ray start --head`` cluster, with Ray's
token authentication on (the submitting shell sets RAY_AUTH_MODE=token, as the README says)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_job_submit_runs_kvray(tmp_path):
    gcs, dashboard = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "token"}
    subprocess.run(
        [
            "ray",
            "start",
            "--head",
            "--num-cpus",
            "2",
            "--port",
            str(gcs),
            "--dashboard-port",
            str(dashboard),
            "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    try:
        result = subprocess.run(
            [
                "ray",
                "job",
                "submit",
                "--address",
                f"http://127.0.0.1:{dashboard}",
                "--working-dir",
                str(ROOT),
                "--",
                "kvray",
                "generate",
                "--prompt",
                "Hello from a Ray job",
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--output",
                "json",
                "-tp",
                "2",
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
            env=env,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        line = next(x for x in result.stdout.splitlines() if x.startswith('{"request_id"'))
        completion = json.loads(line)
        assert len(completion["token_ids"]) == 6
        assert "succeeded" in result.stdout
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120, env=env)
