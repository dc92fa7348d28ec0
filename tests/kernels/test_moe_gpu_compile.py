"""The fused-MoE kernels compile to cubins for sm_90 and fit its shared memory, in bf16 at
DeepSeek-V3's per-rank sizes (hidden 7168; 256 experts of 2048 intermediate rows, top 8):
under TP 8 with every expert split (256 experts of 256 rows per rank), under expert
parallelism over 8 ranks (32 whole experts per rank), with ungated relu² experts (NemotronH's)
at the TP 8 split, and with gpt-oss's biased, clamped SwiGLU experts under EP 8. The method of
``test_mla_gpu_compile.py`` (``tests/kernels/compile_launches.py``): the real launcher, its
kernels recorded, each launch compiled in a fresh process without the interpreter. The weights
are ``torch.empty``: the kernels never run, and untouched pages cost nothing."""

from __future__ import annotations

from tests.kernels.compile_launches import (
    check_compiles,
    compile_in_pool,
    compile_job,
    job_name,
    jobs_for,
    record_launches,
)

# name -> the kernels its launcher must launch, in order.
VARIANTS = {
    "experts bf16 tp8": ["_gate_up_kernel", "_down_kernel"],
    "experts bf16 ep8": ["_gate_up_kernel", "_down_kernel"],
    "ungated bf16 tp8": ["_gate_up_kernel", "_down_kernel"],  # NemotronH's relu² experts
    "swiglu bf16 ep8": ["_gate_up_kernel", "_down_kernel"],  # gpt-oss's, with biases
}
JOBS = jobs_for(VARIANTS)
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, RANKS = 7168, 2048, 256, 8, 8


def test_every_moe_kernel_compiles_for_sm90(tmp_path):
    check_compiles(
        "tests.kernels.test_moe_gpu_compile", [job_name(VARIANTS, job) for job in JOBS], tmp_path
    )


# --- The child process. ---


def compile_all() -> None:
    compile_in_pool(JOBS, _compile_job)


def _compile_job(job) -> tuple[str, dict]:
    return compile_job(job, VARIANTS, _record)


def _record(variant: str) -> list[tuple]:
    from kernels.moe import triton_moe

    return record_launches((triton_moe,), _launcher_call(variant))


def _launcher_call(variant: str):
    """Five tokens' top-8 routing through one rank's experts."""
    import functools

    import torch

    from kernels.moe.reference import ExpertKind
    from kernels.moe.triton_moe import fused_experts

    if variant.endswith("ep8"):
        experts, rows = EXPERTS // RANKS, INTERMEDIATE
    else:
        experts, rows = EXPERTS, INTERMEDIATE // RANKS
    gated = not variant.startswith("ungated")
    dtype = torch.bfloat16
    w13 = torch.empty(experts, (2 if gated else 1) * rows, HIDDEN, dtype=dtype)
    w2 = torch.empty(experts, HIDDEN, rows, dtype=dtype)
    hidden = torch.zeros(5, HIDDEN, dtype=dtype)
    ids = torch.randint(0, experts + 1, (5, TOP_K))  # experts: held by another rank
    weights = torch.full((5, TOP_K), 1 / TOP_K, dtype=dtype)
    extra = {}
    if not gated:
        extra = {"kind": ExpertKind(gated=False, activation="relu2")}
    if variant.startswith("swiglu"):
        extra = {
            "kind": ExpertKind(activation="swiglu_oai"),
            "b13": torch.empty(experts, 2 * rows, dtype=dtype),
            "b2": torch.empty(experts, HIDDEN, dtype=dtype),
        }
    return functools.partial(fused_experts, hidden, w13, w2, weights, ids, **extra)
