"""Every Mamba kernel the backends launch compiles to a cubin for sm_90 and fits its
shared memory.

The same check as ``test_gpu_compile.py`` (read its docstring for why the interpreter is not
enough): a fresh process without the interpreter calls the real launchers with each kernel
replaced by a recorder, then compiles every recorded launch through triton's own launch path
with a stand-in driver. A variant is one launcher call; it records one launch per kernel
(five for the SSD prefill, two or three for the conv prefill), each compiled on its own.
Shapes are NemotronH's (conv width 4, head dim 64, state 128, chunk 128; 8 heads and 2 groups,
one rank's share under TP), in the model's dtypes (bf16 activations, fp32 or bf16 states).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
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

# name -> the kernels its launcher must launch, in order.
VARIANTS = {
    "conv1d_prefill bf16": ["_conv1d_prefill_kernel", "_conv1d_state_kernel",
                            "_conv1d_state_kernel"],
    "conv1d_decode bf16": ["_conv1d_decode_kernel"],
    "ssd_prefill bf16 state fp32": ["_chunk_cumsum_kernel", "_chunk_state_kernel",
                                    "_chunk_cb_kernel", "_state_passing_kernel",
                                    "_chunk_scan_kernel"],
    "ssd_prefill fp32 state bf16": ["_chunk_cumsum_kernel", "_chunk_state_kernel",
                                    "_chunk_cb_kernel", "_state_passing_kernel",
                                    "_chunk_scan_kernel"],
    "ssd_decode bf16 state fp32": ["_state_update_kernel"],
    "ssd_decode bf16 state bf16": ["_state_update_kernel"],
}  # fmt: skip
# sm_90 only (the H200s kvray targets): the attention kernels' compile test covers sm_80 too,
# and these kernels use nothing sm_80 lacks; each extra arch is ~15 s of CI.
MAMBA_ARCHS = [arch for arch in ARCHS if arch == "sm_90"]
JOBS = [(v, i, arch) for v, kernels in VARIANTS.items() for i in range(len(kernels))
        for arch in MAMBA_ARCHS]  # fmt: skip


def job_name(job) -> str:
    variant, index, arch = job
    return f"{arch} {variant} {VARIANTS[variant][index]}"


def test_every_mamba_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = "from tests.kernels.test_mamba_gpu_compile import compile_all; compile_all()"
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
    assert [r["name"] for r in results] == [job_name(job) for job in JOBS]
    assert all(r["cubin_bytes"] > 0 for r in results)
    too_big = [r for r in results if r["shared_bytes"] > MAX_SHARED_BYTES[r["name"].split()[0]]]
    assert not too_big, too_big


# --- The child process. ---


def compile_all() -> None:
    assert "TRITON_INTERPRET" not in os.environ, "under the interpreter nothing is compiled"
    num_workers = min(len(os.sched_getaffinity(0)), MAX_WORKERS)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_workers, mp_context=context) as pool:
        for name, report in pool.map(_compile_job, JOBS):
            print(json.dumps({"name": name, **report}), flush=True)


def _compile_job(job) -> tuple[str, dict]:
    variant, index, arch = job
    name = job_name(job)
    print(f"{STARTED} {name}", file=sys.stderr, flush=True)
    try:
        launches = _record(variant)
        names = [kernel_name for kernel_name, *_ in launches]
        assert names == VARIANTS[variant], f"the launcher launched {names}"
        _, kernel, args, constexprs = launches[index]
        report = _compile(kernel, args, constexprs, ARCHS[arch])
    except Exception as error:
        report = {"error": _describe(error)}
    print(f"{FINISHED} {name}", file=sys.stderr, flush=True)
    return name, report


def _record(variant: str) -> list[tuple]:
    """(kernel name, kernel, args, constexprs) of every launch the variant's launcher makes."""
    from kernels.mamba import (
        triton_conv1d,
        triton_ssd_chunk,
        triton_ssd_scan,
        triton_state_update,
    )

    modules = [triton_conv1d, triton_ssd_chunk, triton_ssd_scan, triton_state_update]
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
        _launcher_call(variant)()
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)
    return launches


def _launcher_call(variant: str):
    """The variant's launcher on NemotronH-shaped tensors: two requests, one with an initial
    state and a checkpoint, in a strided view of a byte buffer."""
    import functools

    import torch

    from kernels.mamba.triton_conv1d import conv1d_decode, conv1d_prefill
    from kernels.mamba.triton_ssd import ssd_prefill
    from kernels.mamba.triton_state_update import ssd_decode

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    words = variant.split()
    act_dtype = dtypes[words[1]]
    state_dtype = dtypes[words[3]] if len(words) > 3 else act_dtype
    heads, head_dim, groups, state_size, width, chunk = 8, 64, 2, 128, 4, 128
    dim = heads * head_dim + 2 * groups * state_size
    slots = torch.tensor([3, 1], dtype=torch.int32)
    has_initial = torch.tensor([True, False])
    qsl = torch.tensor([0, 300, 301], dtype=torch.int32)
    starts = torch.tensor([128, 0], dtype=torch.int32)
    raw = torch.zeros(2 << 22, dtype=torch.int8)

    def state(shape):  # slots two apart in a byte buffer, as kvcore lays them out
        size = torch.empty(shape[1:]).numel()
        strides = [2 * size, *torch.empty(shape[1:]).stride()]
        return raw.view(state_dtype)[: 2 * size * shape[0]].as_strided(shape, strides)

    if words[0] == "conv1d_prefill":
        x = torch.zeros(301, dim, dtype=act_dtype)
        ckpt = torch.tensor([[0, 128, 5]], dtype=torch.int32)
        return functools.partial(
            conv1d_prefill, x, torch.zeros(dim, width, dtype=act_dtype),
            torch.zeros(dim, dtype=act_dtype), state((8, width - 1, dim)), slots, has_initial,
            qsl, ckpt,
        )  # fmt: skip
    if words[0] == "conv1d_decode":
        return functools.partial(
            conv1d_decode, torch.zeros(2, dim, dtype=act_dtype),
            torch.zeros(dim, width, dtype=act_dtype), None, state((8, width - 1, dim)), slots,
        )  # fmt: skip
    num_tokens = 301 if words[0] == "ssd_prefill" else 2
    x = torch.zeros(num_tokens, heads, head_dim, dtype=act_dtype)
    dt = torch.zeros(num_tokens, heads, dtype=act_dtype)
    bc = torch.zeros(num_tokens, 2 * groups, state_size, dtype=act_dtype)
    A = -torch.ones(heads)
    params = (A, bc[:, :groups], bc[:, groups:], torch.ones(heads), torch.zeros(heads))
    ssm_state = state((8, heads, head_dim, state_size))
    if words[0] == "ssd_decode":
        return functools.partial(ssd_decode, x, dt, *params[:3], *params[3:], ssm_state, slots,
                                 dt_min=1e-4)  # fmt: skip
    ckpt = torch.tensor([[0, 256, 5]], dtype=torch.int32)
    return functools.partial(
        ssd_prefill, x, dt, *params, ssm_state, slots, has_initial, qsl, chunk, dt_min=1e-4,
        start_positions=starts, checkpoints=ckpt,
    )  # fmt: skip
