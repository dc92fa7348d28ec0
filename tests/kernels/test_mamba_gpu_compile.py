"""Every Mamba kernel the backends launch compiles to a cubin for sm_90 and fits its
shared memory.

The same check as ``test_gpu_compile.py`` (read its docstring for why the interpreter is not
enough): a fresh process without the interpreter calls the real launchers with each kernel
replaced by a recorder, then compiles every recorded launch through triton's own launch path
with a stand-in driver. A variant is one launcher call; it records one launch per kernel
(five for the SSD prefill, two or three for the conv prefill), each compiled on its own.
Shapes are NemotronH's (conv width 4, head dim 64, state 128, chunk 128, and 1 as drafts are
verified in; 8 heads and 2 groups, one rank's share under TP), in the model's dtypes (bf16
activations, fp32 or bf16 states).
"""

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
    "conv1d_prefill bf16": ["_conv1d_prefill_kernel", "_conv1d_state_kernel",
                            "_conv1d_state_kernel"],
    "conv1d_decode bf16": ["_conv1d_decode_kernel"],
    "ssd_prefill bf16 state fp32": ["_chunk_cumsum_kernel", "_chunk_state_kernel",
                                    "_chunk_cb_kernel", "_state_passing_kernel",
                                    "_chunk_scan_kernel"],
    "ssd_prefill fp32 state bf16": ["_chunk_cumsum_kernel", "_chunk_state_kernel",
                                    "_chunk_cb_kernel", "_state_passing_kernel",
                                    "_chunk_scan_kernel"],
    # A request verifying drafts scans one token a chunk (``workers.kinds.mamba_metadata``).
    "ssd_prefill bf16 state fp32 chunk 1": ["_chunk_cumsum_kernel", "_chunk_state_kernel",
                                            "_chunk_cb_kernel", "_state_passing_kernel",
                                            "_chunk_scan_kernel"],
    "ssd_decode bf16 state fp32": ["_state_update_kernel"],
    "ssd_decode bf16 state bf16": ["_state_update_kernel"],
}  # fmt: skip
JOBS = jobs_for(VARIANTS)


def test_every_mamba_kernel_compiles_for_sm90(tmp_path):
    check_compiles(
        "tests.kernels.test_mamba_gpu_compile", [job_name(VARIANTS, job) for job in JOBS], tmp_path
    )


# --- The child process. ---


def compile_all() -> None:
    compile_in_pool(JOBS, _compile_job)


def _compile_job(job) -> tuple[str, dict]:
    return compile_job(job, VARIANTS, _record)


def _record(variant: str) -> list[tuple]:
    """(kernel name, kernel, args, constexprs) of every launch the variant's launcher makes."""
    from kernels.mamba import (
        triton_conv1d,
        triton_ssd_chunk,
        triton_ssd_scan,
        triton_state_update,
    )

    modules = [triton_conv1d, triton_ssd_chunk, triton_ssd_scan, triton_state_update]
    return record_launches(modules, _launcher_call(variant))


def _launcher_call(variant: str):
    """The variant's launcher on NemotronH-shaped tensors: two requests, one with an initial
    state and a checkpoint, in a strided view of a byte buffer."""
    import functools

    import torch

    from kernels.mamba import ConvWeights, SSDParams, VarlenBatch
    from kernels.mamba.triton_conv1d import conv1d_decode, conv1d_prefill
    from kernels.mamba.triton_ssd import ssd_prefill
    from kernels.mamba.triton_state_update import ssd_decode

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    words = variant.split()
    act_dtype = dtypes[words[1]]
    state_dtype = dtypes[words[3]] if len(words) > 3 else act_dtype
    heads, head_dim, groups, state_size, width = 8, 64, 2, 128, 4
    chunk = int(words[-1]) if "chunk" in words else 128
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
        conv = ConvWeights(
            torch.zeros(dim, width, dtype=act_dtype), torch.zeros(dim, dtype=act_dtype)
        )
        batch = VarlenBatch(slots, has_initial, qsl, checkpoints=ckpt)
        return functools.partial(conv1d_prefill, x, conv, state((8, width - 1, dim)), batch)
    if words[0] == "conv1d_decode":
        conv = ConvWeights(torch.zeros(dim, width, dtype=act_dtype), None)
        return functools.partial(
            conv1d_decode, torch.zeros(2, dim, dtype=act_dtype), conv, state((8, width - 1, dim)),
            slots,
        )  # fmt: skip
    num_tokens = 301 if words[0] == "ssd_prefill" else 2
    x = torch.zeros(num_tokens, heads, head_dim, dtype=act_dtype)
    dt = torch.zeros(num_tokens, heads, dtype=act_dtype)
    bc = torch.zeros(num_tokens, 2 * groups, state_size, dtype=act_dtype)
    params = SSDParams(-torch.ones(heads), torch.ones(heads), torch.zeros(heads), dt_min=1e-4)
    B, C = bc[:, :groups], bc[:, groups:]
    ssm_state = state((8, heads, head_dim, state_size))
    if words[0] == "ssd_decode":
        return functools.partial(ssd_decode, x, dt, B, C, params, ssm_state, slots)
    ckpt = torch.tensor([[0, 256, 5]], dtype=torch.int32)
    batch = VarlenBatch(slots, has_initial, qsl, starts, ckpt, chunk)
    return functools.partial(ssd_prefill, x, dt, B, C, params, ssm_state, batch)
