"""Every MLA kernel the backends launch compiles to a cubin for sm_90 and fits its shared
memory.

The same check as ``test_gpu_compile.py`` (read its docstring for why the interpreter is not
enough): a fresh process without the interpreter calls the real launchers with each kernel
replaced by a recorder, then compiles every recorded launch through triton's own launch path
with a stand-in driver. A variant is one launcher call; decode records two launches (split,
merge), each compiled on its own. Shapes: DeepSeek-V3's latent (L 512, rope 64, 16 query
heads: one rank's share of 128 under TP 8) in bf16, and a tiny config's (L 16, rope 16) in
fp32, whose products take the ieee path.
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
from tests.kernels.test_mamba_gpu_compile import MAMBA_ARCHS

# name -> the kernels its launcher must launch, in order.
VARIANTS = {
    "write_latent bf16 d512/64": ["_latent_write_kernel"],
    "decode bf16 d512/64": ["_decode_split_kernel", "_merge_splits_kernel"],
    "decode fp32 d16/16": ["_decode_split_kernel", "_merge_splits_kernel"],
}
JOBS = [(v, i, arch) for v, kernels in VARIANTS.items() for i in range(len(kernels))
        for arch in MAMBA_ARCHS]  # fmt: skip


def job_name(job) -> str:
    variant, index, arch = job
    return f"{arch} {variant} {VARIANTS[variant][index]}"


def test_every_mla_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = "from tests.kernels.test_mla_gpu_compile import compile_all; compile_all()"
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
    from kernels.mla import triton_decode, triton_write

    launches, originals = [], {}

    def recorder(module, name):
        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **constexprs):
                    launches.append((name, originals[module, name], args, constexprs))

                return launch

        return Recorder()

    for module in (triton_decode, triton_write):
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
    """The variant's launcher over a kvcore MLA view (block-outermost, two layers): three
    decode requests of 1, 37 and 300 tokens, 4 splits."""
    import functools

    import torch

    import kvcore
    from kernels.metadata import build_attention_metadata
    from kernels.mla.triton_decode import mla_decode
    from kernels.mla.triton_write import write_latent

    kind, dtype_name, sizes = variant.split()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    latent_size, rope_size = (int(s) for s in sizes.removeprefix("d").split("/"))
    num_heads, block_size = 16, 64
    spec = kvcore.MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                   head_size=latent_size + rope_size,
                                   dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    tensor = kvcore.build_kv_cache_tensor(spec, ["a", "b"], 8, "BLHNC")
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    cache = kvcore.create_kv_cache_views(raw, spec, 8, "BLHNC", tensor)["b"]
    metadata = build_attention_metadata([1, 1, 1], [1, 37, 300], [[0], [1], [2, 3, 4, 5, 6]],
                                        block_size)  # fmt: skip
    if kind == "write_latent":
        fused = torch.zeros(3, latent_size + rope_size, dtype=dtype)  # the model's [c | k_pe]
        return functools.partial(write_latent, fused[:, :latent_size], fused[:, latent_size:],
                                 cache, metadata.slot_mapping)  # fmt: skip
    q_latent = torch.zeros(3, num_heads, latent_size, dtype=dtype)
    q_pe = torch.zeros(3, num_heads, rope_size, dtype=dtype)
    return functools.partial(mla_decode, q_latent, q_pe, cache, metadata.block_table,
                             metadata.seq_lens, block_size, 0.1, 4)  # fmt: skip
