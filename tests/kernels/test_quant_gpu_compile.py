"""The GGUF matmul kernel compiles to a cubin for sm_90 and fits its shared memory, for Q4
(Q4_0 and Q4_1 share it) and Q8_0 weights, at each row tile (a decode step, a short chunk, a
prefill) and in each activation dtype: Llama-3-8B's MLP down projection under TP 2 (7168
input features of 14336, 4096 out). The method of ``test_mla_gpu_compile.py``
(``tests/kernels/compile_launches.py``): the real launcher, its kernel recorded, each launch
compiled in a fresh process without the interpreter; the weights are ``torch.empty``."""

from __future__ import annotations

from tests.kernels.compile_launches import (
    check_compiles,
    compile_in_pool,
    compile_job,
    job_name,
    jobs_for,
    record_launches,
)

# "kind dtype rows" -> the kernels its launcher must launch.
VARIANTS = {
    "q4 bf16 1": ["_gguf_matmul_kernel"],
    "q4 bf16 24": ["_gguf_matmul_kernel"],
    "q4 bf16 2048": ["_gguf_matmul_kernel"],
    "q8 bf16 1": ["_gguf_matmul_kernel"],
    "q8 bf16 2048": ["_gguf_matmul_kernel"],
    "q4 fp16 1": ["_gguf_matmul_kernel"],
    "q4 fp32 1": ["_gguf_matmul_kernel"],
}
JOBS = jobs_for(VARIANTS)
IN_FEATURES, OUT_FEATURES = 7168, 4096


def test_the_gguf_matmul_compiles_for_sm90(tmp_path):
    check_compiles(
        "tests.kernels.test_quant_gpu_compile", [job_name(VARIANTS, job) for job in JOBS], tmp_path
    )


# --- The child process. ---


def compile_all() -> None:
    compile_in_pool(JOBS, _compile_job)


def _compile_job(job) -> tuple[str, dict]:
    return compile_job(job, VARIANTS, _record)


def _record(variant: str) -> list[tuple]:
    from kernels.quant import triton_matmul

    return record_launches((triton_matmul,), _launcher_call(variant))


def _launcher_call(variant: str):
    import functools

    import torch

    from kernels.quant.gguf_blocks import Q4, QuantizedMatrix
    from kernels.quant.triton_matmul import quantized_linear

    kind, dtype_name, rows = variant.split()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    blocks = IN_FEATURES // 32
    if kind == "q4":
        qs = torch.empty(OUT_FEATURES, IN_FEATURES // 2, dtype=torch.uint8)
        mins = torch.empty(OUT_FEATURES, blocks, dtype=torch.float16)
    else:
        qs = torch.empty(OUT_FEATURES, IN_FEATURES, dtype=torch.int8)
        mins = torch.empty(OUT_FEATURES, 0, dtype=torch.float16)
    scales = torch.empty(OUT_FEATURES, blocks, dtype=torch.float16)
    weight = QuantizedMatrix(Q4 if kind == "q4" else kind, qs, scales, mins)
    x = torch.empty(int(rows), IN_FEATURES, dtype=dtype)
    return functools.partial(quantized_linear, x, weight)
