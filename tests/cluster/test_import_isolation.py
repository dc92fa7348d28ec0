"""What the client, the scheduler and the engine load: the client neither torch nor ray (a
laptop talks to a cluster with ``pip install kvray``), the scheduler and the engine no torch
(the controller plans steps through ``workers.protocol``, which is plain msgspec). Each import
runs in a fresh interpreter, so nothing a test imported earlier hides a dependency."""

from __future__ import annotations

import subprocess
import sys

import pytest


def heavy_modules_loaded_by(module: str) -> list[str]:
    code = (
        f"import sys, {module}\n"
        "print(','.join(m for m in ('torch', 'ray', 'triton') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return [name for name in result.stdout.strip().split(",") if name]


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("cluster.client", {"torch", "ray", "triton"}),
        ("cluster.scheduler.scheduler", {"torch", "triton"}),
        ("cluster.engine", {"torch", "triton"}),
        ("workers.protocol", {"torch", "ray", "triton"}),
    ],
)
def test_light_modules_load_no_heavy_dependency(module, forbidden):
    assert not forbidden & set(heavy_modules_loaded_by(module))
