"""Every MLA kernel the backends launch compiles to a cubin for sm_90 and fits its shared
memory.

The same check as ``test_gpu_compile.py`` (read its docstring for why the interpreter is not
enough): a fresh process without the interpreter calls the real launchers with each kernel
replaced by a recorder, then compiles every recorded launch through triton's own launch path
with a stand-in driver. A variant is one launcher call; decode records two launches (split,
merge), each compiled on its own; the expanded prefill is the MLA layer's own code handing the
paged prefill kernel K of P + R and V of V per head, in blocks of one token. Shapes:
DeepSeek-V3's latent (L 512, rope 64, nope and V 128, 16 query heads: one rank's share of 128
under TP 8) in bf16, and a tiny config's (L 16, rope 16) in fp32, whose products take the
ieee path.
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
    "write_latent bf16 d512/64": ["_latent_write_kernel"],
    "decode bf16 d512/64": ["_decode_split_kernel", "_merge_splits_kernel"],
    "decode fp32 d16/16": ["_decode_split_kernel", "_merge_splits_kernel"],
    "prefill_expanded bf16 d512/64": ["_paged_attention_kernel"],
}
JOBS = jobs_for(VARIANTS)


def test_every_mla_kernel_compiles_for_sm90(tmp_path):
    check_compiles(
        "tests.kernels.test_mla_gpu_compile", [job_name(VARIANTS, job) for job in JOBS], tmp_path
    )


# --- The child process. ---


def compile_all() -> None:
    compile_in_pool(JOBS, _compile_job)


def _compile_job(job) -> tuple[str, dict]:
    return compile_job(job, VARIANTS, _record)


def _record(variant: str) -> list[tuple]:
    """(kernel name, kernel, args, constexprs) of every launch the variant's launcher makes."""
    from kernels.attention import paged_attention
    from kernels.mla import triton_decode, triton_write

    modules = (triton_decode, triton_write, paged_attention)
    return record_launches(modules, _launcher_call(variant))


def _launcher_call(variant: str):
    """The variant's launcher over a kvcore MLA view (block-outermost, two layers): three
    decode requests of 1, 37 and 300 tokens, 4 splits."""
    import functools

    import torch

    import kvcore
    from kernels.attention.metadata import build_attention_metadata
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
    if kind == "prefill_expanded":
        return _expanded_prefill_call(cache, block_size, num_heads, dtype, latent_size, rope_size)
    if kind == "write_latent":
        fused = torch.zeros(3, latent_size + rope_size, dtype=dtype)  # the model's [c | k_pe]
        return functools.partial(write_latent, fused[:, :latent_size], fused[:, latent_size:],
                                 cache, metadata.slot_mapping)  # fmt: skip
    q_latent = torch.zeros(3, num_heads, latent_size, dtype=dtype)
    q_pe = torch.zeros(3, num_heads, rope_size, dtype=dtype)
    return functools.partial(mla_decode, q_latent, q_pe, cache, metadata.block_table,
                             metadata.seq_lens, block_size, 0.1, 4)  # fmt: skip


def _expanded_prefill_call(cache, block_size, num_heads, dtype, latent_size, rope_size):
    """The MLA layer's expansion of one prefill chunk (128 new tokens, 300 in context) into
    per-head K/V for the paged prefill kernel."""
    import functools
    from types import SimpleNamespace

    import torch

    from kernels.attention.metadata import build_attention_metadata
    from kernels.attention.paged_attention import paged_attention
    from workers.kinds.mla_metadata import build_mla_metadata
    from workers.layers.mla_attention import MLAAttention
    from workers.model_config import MLAConfig

    mla = MLAConfig(
        kv_lora_rank=latent_size, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=rope_size, v_head_dim=128, rope_interleave=True, attention_bias=False,
    )  # fmt: skip
    layer = MLAAttention("b", num_heads, mla, scale=0.1)
    layer.kv_cache = cache
    rows = torch.tensor([[2, 3, 4, 5, 6]], dtype=torch.int32)
    attention = build_attention_metadata([128], [300], rows, block_size)
    metadata = build_mla_metadata(attention, [128], [300], rows, "cpu", expand_budget=2048)
    kernels = SimpleNamespace(attention=SimpleNamespace(attend=paged_attention))
    q_nope = torch.zeros(128, num_heads, mla.qk_nope_head_dim, dtype=dtype)
    q_pe = torch.zeros(128, num_heads, rope_size, dtype=dtype)
    kv_b = torch.zeros(
        num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), latent_size, dtype=dtype
    )
    return functools.partial(layer._attend_expanded, kernels, metadata.expanded, q_nope, q_pe, kv_b)
