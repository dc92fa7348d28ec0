"""The kernels compile for a Hopper GPU (sm_90), checked on any machine.

The interpreter accepts things the compiler refuses (non-constexpr globals, loop-carried type
changes, dot shapes below 16), so a CPU-only CI would otherwise never see them. A fresh
process imports triton without the interpreter, takes each launcher's own compile-time
settings for realistic shapes, and compiles down to a cubin with the bundled ptxas.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch, triton, kvcore
    from triton.backends.compiler import GPUTarget
    from kernels import cache_write, paged_attention
    from kernels.metadata import build_attention_metadata
    from kernels.params import AttentionParams

    POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
                     torch.int64: "*i64"}

    def compile_for_sm90(fn, tensors, floats, constexprs):
        signature = {}
        for name in fn.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in tensors:
                signature[name] = POINTER_TYPES[tensors[name].dtype]
            else:
                signature[name] = "fp32" if name in floats else "i32"
        keyed = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
        source = triton.compiler.ASTSource(fn, signature, constexprs=keyed)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], fn.__name__

    for dtype, features, query_len in [
        (torch.bfloat16, dict(sliding_window=512, softcap=30.0, sinks=torch.zeros(32)), 1),
        (torch.float32, {}, 128),
    ]:
        spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                        dtype=str(dtype).removeprefix("torch."))
        tensor = kvcore.build_kv_cache_tensor(spec, ["l"], 16, "BHLNC")
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        cache = kvcore.create_kv_cache_views(raw, spec, 16, "BHLNC", tensor)["l"]
        metadata = build_attention_metadata([query_len], [200], [list(range(13))], 16)
        params = AttentionParams(scale=0.1, num_kv_heads=8, **features)
        query = torch.zeros(query_len, 32, 128, dtype=dtype)
        kv = torch.zeros(query_len, 8, 128, dtype=dtype)
        compile_for_sm90(
            paged_attention._paged_attention_kernel,
            dict(out_ptr=query, query_ptr=query, cache_ptr=cache,
                 block_table_ptr=metadata.block_table,
                 query_start_loc_ptr=metadata.query_start_loc,
                 seq_lens_ptr=metadata.seq_lens, sinks_ptr=torch.zeros(32)),
            {"scale", "softcap"},
            paged_attention.launch_constexprs(query, cache, metadata, params),
        )
        print("attention", dtype)
        if dtype == torch.float32:
            continue  # one cache write suffices: it has no dtype-specific code
        compile_for_sm90(
            cache_write._cache_write_kernel,
            dict(key_ptr=kv, value_ptr=kv, cache_ptr=cache,
                 slot_mapping_ptr=metadata.slot_mapping),
            set(),
            cache_write.launch_constexprs(kv, kv, cache),
        )
        print("cache_write", dtype)
    """
)


def test_kernels_compile_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == [
        "attention", "torch.bfloat16", "cache_write", "torch.bfloat16",
        "attention", "torch.float32",
    ]  # fmt: skip
