"""One command that checks and measures kvray on a GPU machine and prints one table.

    python -m cluster.bench.gpu_check              # on a machine with NVIDIA GPUs: < 10 min
    python -m cluster.bench.gpu_check --smoke      # the same parts, CPU-sized (CI)

It needs torch, triton and kvray's small wheels (msgspec, grpcio, numpy), not Ray: a GPU host
may have no room for Ray's wheel, so every part but the Ray one runs its engine in-process.
The parts, each a subprocess with its own deadline and unbuffered output written straight to
its log (a part that fails or runs out of time is reported so, keeps what it printed, and the
others still run):

1. ``kernels``: ``cluster.bench.kernel_accuracy``: Triton attention and cache write against the
   references in float32, bfloat16 and float16, every layout, head size 128; max relative error.
2. ``mla/mamba``: ``cluster.bench.mla_mamba_accuracy``: the MLA latent write and split-KV
   decode (every layout) and the Mamba conv1d and SSD scan (prefill and decode) against their
   torch references in the same three dtypes, at DeepSeek-V3 and NemotronH per-rank sizes.
3. ``engine``: ``cluster.bench.engine_parity``: two in-process engines in bfloat16, torch then
   Triton attention, in one process: token parity, each one's memory budget line, and the
   compile stall of a fresh Triton cache.
4. ``attention``: ``kernels.attention.bench``: decode bandwidth as a share of the device's copy
   bandwidth, prefill against SDPA, every layout.
5. ``throughput``: ``kvray bench throughput --in-process``, against transformers on the same
   device and dtype when transformers is installed.
6. ``ray tests``: ``pytest -m gpu tests/e2e``: serving through Ray (six layouts, sampling,
   TP 2 on two GPUs, MLA); skipped where Ray or pytest is not installed.

Every part's full output is kept in ``--output-dir`` beside a ``summary.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Part:
    name: str
    status: str  # "passed", "failed (exit N)", "timed out", "skipped (why)"
    seconds: float
    figures: str  # the headline numbers, one line


def run_part(name: str, command: list[str], timeout: float, output_dir: Path):
    """Run ``command`` with its output going straight to ``NAME.log`` (kept, whole, when the
    deadline kills it); returns (status, seconds, its output)."""
    log = output_dir / log_name(name)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with log.open("w") as out:
        try:
            code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=env).returncode  # fmt: skip
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = "timed out"
    return status, time.perf_counter() - started, log.read_text(errors="replace")


def log_name(part: str) -> str:
    return re.sub(r"[ /]", "-", part) + ".log"


def summary_line(output: str) -> str:
    """The ``summary: ...`` line a part prints last."""
    lines = [line for line in output.splitlines() if line.startswith("summary: ")]
    return lines[-1].removeprefix("summary: ") if lines else "no summary"


def pytest_figures(output: str) -> str:
    last = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    return last[-1].strip("= ") if last else "no summary"


def attention_figures(output: str) -> str:
    of_copy = [float(m) for m in re.findall(r"\s([\d.]+)%\s*$", output, flags=re.MULTILINE)]
    worst = [float(m) for m in re.findall(r"worst layout at ([\d.]+)%", output)]
    vs_sdpa = [float(m) for m in re.findall(r"([\d.]+)x\s*$", output, flags=re.MULTILINE)]
    parts = []
    if of_copy:
        parts.append(f"decode up to {max(of_copy):.0f}% of copy bandwidth")
    if worst:
        parts.append(f"worst layout at {min(worst):.0f}% of the best")
    if vs_sdpa:
        parts.append(f"prefill {min(vs_sdpa):.2f}-{max(vs_sdpa):.2f}x SDPA")
    return "; ".join(parts) or "no figures"


def throughput_figures(report: Path) -> str:
    if not report.exists():
        return "no report"
    rows = json.loads(report.read_text())["results"]
    return "; ".join(
        f"{row['engine']}: {row['output_tokens_per_s']:.0f} out tok/s"
        + (f" ({row['kvray_speedup']:.2f}x)" if "kvray_speedup" in row else "")
        for row in rows
    )


def environment() -> str:
    if not torch.cuda.is_available():
        return f"no GPU; torch {torch.__version__}, {platform.machine()}"
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    import triton

    return (
        f"{torch.cuda.device_count()} x {', '.join(sorted(names))}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {triton.__version__}"
    )


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def plan_parts(smoke: bool, report: Path) -> list[tuple[str, list[str], float, str | None]]:
    """(name, command, deadline in seconds, why it is skipped or None) for every part."""
    python = sys.executable
    small = ["--smoke"] if smoke else []
    sizes = (
        ["--num-prompts", "4", "--input-len", "8-24", "--output-len", "4-8",
         "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--hf-batch-size", "4"]
        if smoke
        else ["--model", "embedded:20m", "--num-prompts", "256", "--input-len", "32-256",
              "--output-len", "16-256", "--max-model-len", "1024"]
    )  # fmt: skip
    compare = ["--compare", "transformers"] if installed("transformers") else []
    no_ray = next((f"skipped ({m} not installed)" for m in ("ray", "pytest") if not installed(m)),
                  None)  # fmt: skip
    return [
        ("kernels", [python, "-m", "cluster.bench.kernel_accuracy", *small], 150, None),
        ("mla/mamba", [python, "-m", "cluster.bench.mla_mamba_accuracy", *small], 120, None),
        ("engine", [python, "-m", "cluster.bench.engine_parity", *small], 150, None),
        ("attention", [python, "-m", "kernels.attention.bench",
                       *(["--small"] if smoke else [])], 120, None),
        ("throughput", [python, "-m", "cluster.cli", "bench", "throughput", "--in-process",
                        *sizes, *compare, "--output-json", str(report), "--log-level",
                        "WARNING"], 120, None),
        ("ray tests", [python, "-m", "pytest", "-q", "-m", "gpu", "tests/e2e"], 240, no_ray),
    ]  # fmt: skip


def figures_of(name: str, output: str, report: Path) -> str:
    if name in ("kernels", "mla/mamba", "engine"):
        return summary_line(output)
    if name == "attention":
        return attention_figures(output)
    if name == "throughput":
        return throughput_figures(report)
    return pytest_figures(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU-sized parts (CI)")
    parser.add_argument("--output-dir", default=None, help="where the logs go")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir or f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")
    output_dir.mkdir(parents=True, exist_ok=True)
    report = output_dir / "throughput.json"
    print(f"kvray GPU check: {environment()}", flush=True)
    print(f"{'part':<11} {'status':<28} {'seconds':>7}  figures", flush=True)
    parts = []
    for name, command, timeout, skipped in plan_parts(args.smoke, report):
        if skipped:
            part = Part(name, skipped, 0.0, "")
        else:
            status, seconds, output = run_part(name, command, timeout, output_dir)
            part = Part(name, status, seconds, figures_of(name, output, report))
        # One line per part as it ends: a check cut short still shows what it finished.
        print(f"{part.name:<11} {part.status:<28} {part.seconds:>7.0f}  {part.figures}", flush=True)
        parts.append(part)
    summary = {"environment": environment(), "parts": [asdict(p) for p in parts]}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"logs: {output_dir}")
    ran = [p for p in parts if not p.status.startswith("skipped")]
    return 0 if all(p.status == "passed" for p in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
