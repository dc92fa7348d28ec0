"""One command that checks and measures kvray on a GPU machine and prints one table.

    python -m cluster.bench.gpu_check              # on a machine with NVIDIA GPUs: < 8 min
    python -m cluster.bench.gpu_check --smoke      # the same parts, CPU-sized (CI)

The parts, each a subprocess with its own deadline (one that fails or runs out of time is
reported so, and the others still run):

1. ``gpu tests``: ``pytest -m gpu`` (tests/e2e/test_gpu.py): requests served through Ray with
   the Triton backend in all six layouts, bf16, sampling at temperature > 0, TP 2 on two GPUs.
2. ``attention``: ``python -m kernels.attention.bench``: decode bandwidth against the device's
   copy bandwidth, prefill against SDPA, every layout.
3. ``throughput``: ``kvray bench throughput`` through Ray against transformers on the same
   device and dtype.

Every part's full output is kept in ``--output-dir`` beside a ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
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
    status: str  # "passed", "failed", "timed out"
    seconds: float
    figures: str  # the headline numbers, one line


def run_part(name: str, command: list[str], timeout: float, output_dir: Path):
    """Run ``command``; returns (status, seconds, its output), the output also kept on disk."""
    started = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        status = "passed" if result.returncode == 0 else f"failed (exit {result.returncode})"
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as exc:
        status = "timed out"
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(
            errors="replace"
        )
    (output_dir / f"{name}.log").write_text(output)
    return status, time.perf_counter() - started, output


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU-sized parts (CI)")
    parser.add_argument("--output-dir", default=None, help="where the logs go")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir or f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")
    output_dir.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    report = output_dir / "throughput.json"
    sizes = (
        ["--num-prompts", "6", "--input-len", "8-24", "--output-len", "4-12",
         "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--hf-batch-size", "4"]
        if args.smoke
        else ["--model", "embedded:20m", "--num-prompts", "256", "--input-len", "32-256",
              "--output-len", "16-256", "--max-model-len", "1024"]
    )  # fmt: skip
    plan = [
        ("gpu tests", [python, "-m", "pytest", "-q", "-m", "gpu", "tests/e2e"], 240),
        (
            "attention",
            [python, "-m", "kernels.attention.bench", *(["--small"] if args.smoke else [])],
            120,
        ),
        (
            "throughput",
            [python, "-m", "cluster.cli", "bench", "throughput", *sizes,
             "--compare", "transformers", "--output-json", str(report), "--log-level", "WARNING"],
            120,
        ),
    ]  # fmt: skip
    parts = []
    for name, command, timeout in plan:
        status, seconds, output = run_part(name, command, timeout, output_dir)
        if name == "gpu tests":
            figures = pytest_figures(output)
        elif name == "attention":
            figures = attention_figures(output)
        else:
            figures = throughput_figures(report)
        parts.append(Part(name, status, seconds, figures))
    print(f"kvray GPU check: {environment()}")
    print(f"{'part':<11} {'status':<16} {'seconds':>7}  figures")
    for part in parts:
        print(f"{part.name:<11} {part.status:<16} {part.seconds:>7.0f}  {part.figures}")
    summary = {"environment": environment(), "parts": [asdict(p) for p in parts]}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"logs: {output_dir}")
    return 0 if all(p.status == "passed" for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
