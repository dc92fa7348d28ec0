"""The harness of the kernel-family compile checks (``test_mamba_gpu_compile.py``,
``test_mla_gpu_compile.py``), the method of ``test_gpu_compile.py``: in a fresh process
without the interpreter, each variant's real launcher is called with its kernels replaced by
recorders, and every recorded launch is compiled for a GPU architecture through triton's own
launch path with a stand-in driver.

A family module defines ``VARIANTS`` (name -> the kernels its launcher must launch, in order),
its jobs and job names, a module-level ``_compile_job(job)`` calling ``compile_job`` (the
process pool pickles it by name) and a ``compile_all()`` calling ``compile_in_pool``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tests.kernels.test_gpu_compile import (
    ARCHS,
    FINISHED,
    MAX_SHARED_BYTES,
    MAX_WORKERS,
    STARTED,
    _compile,
    _describe,
)

# sm_90 only (the H200s kvray targets): the attention kernels' compile test covers sm_80 too,
# and these families use nothing sm_80 lacks; each extra arch is ~15 s of CI.
FAMILY_ARCHS = [arch for arch in ARCHS if arch == "sm_90"]


def job_name(variants: dict[str, list[str]], job) -> str:
    variant, index, arch = job
    return f"{arch} {variant} {variants[variant][index]}"


def jobs_for(variants: dict[str, list[str]]) -> list[tuple[str, int, str]]:
    return [
        (variant, index, arch)
        for variant, kernels in variants.items()
        for index in range(len(kernels))
        for arch in FAMILY_ARCHS
    ]


def check_compiles(test_module: str, expected_names: list[str], tmp_path: Path) -> None:
    """Run ``test_module.compile_all`` in a fresh process and check every job compiled to a
    cubin that fits its architecture's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = f"from {test_module} import compile_all; compile_all()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    if result.returncode != 0:
        progress = [line.partition(" ")[::2] for line in result.stderr.splitlines()]
        finished = {name for word, name in progress if word == FINISHED}
        in_flight = [name for word, name in progress if word == STARTED and name not in finished]
        pytest.fail(f"The compile process died compiling one of {in_flight}:\n"
                    f"{result.stderr[-4000:]}", pytrace=False)  # fmt: skip
    results = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failures = [f"{r['name']}:\n{r['error']}" for r in results if "error" in r]
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    assert [r["name"] for r in results] == expected_names
    assert all(r["cubin_bytes"] > 0 for r in results)
    too_big = [r for r in results if r["shared_bytes"] > MAX_SHARED_BYTES[r["name"].split()[0]]]
    assert not too_big, too_big


# --- The child process. ---


def compile_in_pool(jobs, compile_one: Callable) -> None:
    assert "TRITON_INTERPRET" not in os.environ, "under the interpreter nothing is compiled"
    num_workers = min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_workers, mp_context=context) as pool:
        for name, report in pool.map(compile_one, jobs):
            print(json.dumps({"name": name, **report}), flush=True)


def compile_job(job, variants: dict[str, list[str]], record: Callable) -> tuple[str, dict]:
    """Compile launch ``index`` of the variant's launcher (``record(variant)`` gives them)."""
    variant, index, arch = job
    name = job_name(variants, job)
    print(f"{STARTED} {name}", file=sys.stderr, flush=True)
    try:
        launches = record(variant)
        names = [kernel_name for kernel_name, *_ in launches]
        assert names == variants[variant], f"the launcher launched {names}"
        _, kernel, args, constexprs = launches[index]
        report = _compile(kernel, args, constexprs, ARCHS[arch])
    except Exception as error:
        report = {"error": _describe(error)}
    print(f"{FINISHED} {name}", file=sys.stderr, flush=True)
    return name, report


def record_launches(modules, call: Callable[[], object]) -> list[tuple]:
    """(kernel name, kernel, args, constexprs) of every launch ``call`` makes of the
    ``*_kernel`` functions of ``modules``, which are not run."""
    launches, originals = [], {}

    def recorder(module, name):
        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **constexprs):
                    launches.append((name, originals[module, name], args, constexprs))

                return launch

        return Recorder()

    for module in modules:
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            originals[module, name] = getattr(module, name)
            setattr(module, name, recorder(module, name))
    try:
        call()
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)
    return launches
