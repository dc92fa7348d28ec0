"""The GPU check command runs end to end, CPU-sized (``--smoke``), and prints its table (the
attention benchmark's own table is checked in its log): the command a GPU session runs must
not be the first time it runs. It runs here as on a bare GPU host without Ray: every process
it starts has ``import ray`` fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import kvcore
from cluster.bench.gpu_check import log_name

BLOCK_RAY = """
import sys

class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is not installed on this host")

sys.meta_path.insert(0, NoRay())
"""


def test_gpu_check_smoke_runs_without_ray_and_prints_one_line_per_part(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_RAY)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    output_dir = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "cluster.bench.gpu_check", "--smoke", "--output-dir",
         str(output_dir)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("kvray GPU check: ")
    summary = json.loads((output_dir / "summary.json").read_text())
    parts = {p["name"]: p for p in summary["parts"]}
    assert list(parts) == ["kernels", "mla/mamba", "engine", "attention", "throughput", "ray tests"]
    assert parts.pop("ray tests")["status"] == "skipped (ray not installed)"
    assert all(p["status"] == "passed" for p in parts.values()), parts
    assert "within bounds" in parts["kernels"]["figures"]
    assert "float16" in parts["kernels"]["figures"]
    assert "within bounds" in parts["mla/mamba"]["figures"]
    assert "2/2 sequences identical" in parts["engine"]["figures"]
    assert "second engine started" in parts["engine"]["figures"]
    assert "of copy bandwidth" in parts["attention"]["figures"]
    assert "kvray" in parts["throughput"]["figures"]
    assert "transformers" in parts["throughput"]["figures"]
    for name in parts:
        assert (output_dir / log_name(name)).exists()
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert_attention_bench_table((output_dir / log_name("attention")).read_text().splitlines())


def assert_attention_bench_table(lines: list[str]) -> None:
    """``kernels.attention.bench --small``: on the CPU every timed call was also checked
    against the torch reference; timings are printed, never asserted."""
    decode_rows = [line for line in lines if line.split()[-1:] and line.endswith("%")]
    for layout in kvcore.valid_layout_names():
        # decode: 2 block sizes x 1 batch x 2 contexts; prefill: 2 block sizes
        assert sum(f"  {layout}  " in line for line in decode_rows) == 4, layout
        assert sum(f"  {layout}  " in line and line.endswith("x") for line in lines) == 2, layout
    assert lines[-1] == "done on cpu"


def test_mla_mamba_accuracy_names_a_kernel_that_leaves_its_output_unwritten(monkeypatch, capsys):
    import torch

    from cluster.bench import mla_mamba_accuracy
    from kernels.mamba.triton_backend import TritonMambaBackend
    from kernels.mla.triton_backend import TritonMLABackend

    def skip_decode(self, q_latent, q_pe, kv_cache, *args, num_splits=1, out=None):
        return out  # still the poisoned buffer

    def nan_decode(self, x, *args):
        return torch.full_like(x, float("nan"))

    monkeypatch.setattr(TritonMLABackend, "decode", skip_decode)
    monkeypatch.setattr(TritonMambaBackend, "ssd_decode", nan_decode)
    assert mla_mamba_accuracy.main(["--smoke"]) == 1
    summary = capsys.readouterr().out.splitlines()[-1]
    assert "failed: float32 MLA decode in BLHNC" in summary
    assert "float32 Mamba ssd decode" in summary
    assert "latent write" not in summary and "conv" not in summary
