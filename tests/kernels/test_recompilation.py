"""Serving never compiles a kernel variant that warm-up did not compile.

Triton keys each compiled variant on its integer arguments as well as its constexprs: an
integer equal to 1 and one divisible by 16 each get a variant of their own, unless the kernel
names the argument in ``do_not_specialize``. An argument that changes every step (the batch's
request count, the block table's width) would so compile up to three variants of a kernel on a
fresh GPU while it serves, seconds each. This test calls the real launchers for the steps a
server meets (1, 2, 16, 17 and 33 requests, block tables 1 to 33 blocks wide, decode and
prefill tiles) with each kernel replaced by a recorder, then, in a fresh process without the
interpreter and with a stand-in Hopper driver, asks triton's own launch path for each recorded
launch's cache key, compiling nothing. Launches of one kernel with the same constexprs and
tensor dtypes (one kernel, dtype and tile) must share one key.

The second test shows the count can fail: a kernel without ``do_not_specialize`` gets three
keys from the same request counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.kernels.compile_launches import record_launches

BATCH_SIZES = (1, 2, 16, 17, 33)
BLOCK_SIZE = 16


def test_serving_steps_reuse_one_variant_per_kernel_dtype_and_tile():
    groups = _child("count_serving_variants")
    kernels = {group.split(" ")[0] for group in groups}
    assert kernels == {
        "_paged_attention_kernel", "_cache_write_kernel", "_decode_split_kernel",
        "_merge_splits_kernel", "_latent_write_kernel", "_conv1d_decode_kernel",
        "_state_update_kernel", "_conv1d_prefill_kernel", "_conv1d_state_kernel",
        "_chunk_cumsum_kernel", "_chunk_state_kernel", "_chunk_cb_kernel",
        "_state_passing_kernel", "_chunk_scan_kernel",
    }  # fmt: skip
    recompiled = {group: keys for group, keys in groups.items() if keys != 1}
    assert not recompiled, f"variants per kernel, dtype and tile: {recompiled}"


def test_the_count_sees_a_kernel_that_specialises():
    assert _child("count_specialising_variants") == {"plain": 3, "not specialised": 1}


def _child(function: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.kernels.test_recompilation import {function}; {function}()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    if result.returncode != 0:
        pytest.fail(result.stderr[-4000:], pytrace=False)
    return json.loads(result.stdout.splitlines()[-1])


# --- The child process. ---


def count_serving_variants() -> None:
    """Prints {"kernel constexprs dtypes": number of cache keys} over every serving step."""
    launches = [*_attention_launches(), *_mla_launches(), *_mamba_launches()]
    print(json.dumps(_count_keys(launches)))


def count_specialising_variants() -> None:
    import torch
    import triton
    import triton.language as tl

    def body(out_ptr, num_reqs, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.int32) + num_reqs)

    kernels = {
        "plain": triton.jit(body),
        "not specialised": triton.jit(body, do_not_specialize=["num_reqs"]),
    }
    out = torch.zeros(16, dtype=torch.int32)
    counts = {}
    for name, kernel in kernels.items():
        launches = [(name, kernel, (out, n), {"BLOCK": 16}) for n in BATCH_SIZES]
        (counts[name],) = _count_keys(launches).values()
    print(json.dumps(counts))


def _count_keys(launches) -> dict[str, int]:
    """The distinct cache keys triton's launch path computes for the launches, per kernel,
    constexprs and tensor dtypes; nothing is compiled."""
    import torch
    from triton.runtime import driver

    from tests.kernels.test_gpu_compile import _AbsentGpu

    assert "TRITON_INTERPRET" not in os.environ, "the interpreter keys nothing"
    driver.set_active(_AbsentGpu(90))
    keys: dict[str, set] = defaultdict(set)
    for name, kernel, args, constexprs in launches:
        dtypes = [str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)]
        settings = ",".join(f"{k}={v}" for k, v in sorted(constexprs.items()))
        group = keys[f"{name} {settings} {'/'.join(dtypes)}"]
        # The key is the first argument of the compile a cache miss calls; a stand-in that
        # returns None compiles nothing and leaves the cache empty.
        kernel._do_compile = lambda key, *rest, group=group: group.add(key)
        kernel.warmup(*args, grid=(1,), **constexprs)
        del kernel._do_compile
    return {group: len(found) for group, found in keys.items()}


def _decode_batch(num_reqs: int) -> tuple[list[int], list[list[int]]]:
    """Sequence lengths and block tables of ``num_reqs`` decoding requests; the last is the
    longest, ``num_reqs`` blocks, so the table is as wide as the batch is large."""
    seq_lens = [1 + (7 * i) % (BLOCK_SIZE * num_reqs - 1) for i in range(num_reqs - 1)]
    seq_lens.append(BLOCK_SIZE * num_reqs - 3)
    tables, next_block = [], 0
    for seq_len in seq_lens:
        width = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + width)))
        next_block += width
    return seq_lens, tables


def _attention_launches() -> list[tuple]:
    import torch

    import kvcore
    from kernels.attention import cache_write, paged_attention
    from kernels.attention.metadata import build_attention_metadata
    from kernels.attention.params import AttentionParams

    launches = []
    for dtype in (torch.bfloat16, torch.float32):
        spec = kvcore.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                                        dtype=str(dtype).removeprefix("torch."))  # fmt: skip
        tensor = kvcore.build_kv_cache_tensor(spec, ["l"], 1200, "BHLNC")
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        cache = kvcore.create_kv_cache_views(raw, spec, 1200, "BHLNC", tensor)["l"]
        for window in (None, 512):
            params = AttentionParams(scale=0.1, num_kv_heads=8, sliding_window=window)
            for num_reqs in BATCH_SIZES:
                seq_lens, tables = _decode_batch(num_reqs)
                for prefill in (0, 130):  # a decode batch; one with a prefill chunk first
                    query_lens = [prefill or 1] + [1] * (num_reqs - 1)
                    lens = [seq_lens[0] + prefill, *seq_lens[1:]]
                    rows = [list(range(1100, 1100 + -(-lens[0] // BLOCK_SIZE))), *tables[1:]]
                    metadata = build_attention_metadata(query_lens, lens, rows, BLOCK_SIZE)
                    tokens = sum(query_lens)
                    query = torch.zeros(tokens, 32, 128, dtype=dtype)
                    key = torch.zeros(tokens, 8, 128, dtype=dtype)

                    def step(query=query, key=key, cache=cache, metadata=metadata, params=params):
                        cache_write.write_kv(key, key, cache, metadata.slot_mapping)
                        paged_attention.paged_attention(query, cache, metadata, params)

                    launches += record_launches([cache_write, paged_attention], step)
    return launches


def _mla_launches() -> list[tuple]:
    import torch

    import kvcore
    from kernels.attention.metadata import build_attention_metadata
    from kernels.mla import triton_decode, triton_write

    spec = kvcore.MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576,
                                   dtype="bfloat16")  # fmt: skip
    tensor = kvcore.build_kv_cache_tensor(spec, ["l"], 600, "BLHNC")
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    cache = kvcore.create_kv_cache_views(raw, spec, 600, "BLHNC", tensor)["l"]
    launches = []
    for num_reqs in BATCH_SIZES:
        seq_lens, tables = _decode_batch(num_reqs)
        metadata = build_attention_metadata([1] * num_reqs, seq_lens, tables, BLOCK_SIZE)
        fused = torch.zeros(num_reqs, 576, dtype=torch.bfloat16)
        q_latent = torch.zeros(num_reqs, 16, 512, dtype=torch.bfloat16)
        q_pe = torch.zeros(num_reqs, 16, 64, dtype=torch.bfloat16)

        def step(fused=fused, q_latent=q_latent, q_pe=q_pe, metadata=metadata):
            triton_write.write_latent(fused[:, :512], fused[:, 512:], cache, metadata.slot_mapping)
            triton_decode.mla_decode(q_latent, q_pe, cache, metadata.block_table,
                                     metadata.seq_lens, BLOCK_SIZE, 0.1)  # fmt: skip

        launches += record_launches([triton_decode, triton_write], step)
    return launches


def _mamba_launches() -> list[tuple]:
    import torch

    from kernels.mamba import (
        ConvWeights,
        SSDParams,
        VarlenBatch,
        triton_conv1d,
        triton_ssd_chunk,
        triton_ssd_scan,
        triton_state_update,
    )
    from kernels.mamba.triton_ssd import ssd_prefill

    heads, head_dim, groups, state_size, width, slots = 8, 64, 2, 128, 4, 40
    dim = heads * head_dim + 2 * groups * state_size
    dtype = torch.bfloat16
    conv = ConvWeights(torch.zeros(dim, width, dtype=dtype), torch.zeros(dim, dtype=dtype))
    conv_state = torch.zeros(slots, width - 1, dim, dtype=dtype)
    ssm_state = torch.zeros(slots, heads, head_dim, state_size, dtype=torch.float32)
    params = SSDParams(-torch.ones(heads), torch.ones(heads), torch.zeros(heads), dt_min=1e-4)
    modules = [triton_conv1d, triton_ssd_chunk, triton_ssd_scan, triton_state_update]
    launches = []
    for num_reqs in BATCH_SIZES:
        indices = torch.arange(num_reqs, dtype=torch.int32)
        for prefill in (False, True):
            lens = [130 + 3 * i if prefill else 1 for i in range(num_reqs)]
            qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            tokens = sum(lens)
            x = torch.zeros(tokens, dim, dtype=dtype)
            xs = torch.zeros(tokens, heads, head_dim, dtype=dtype)
            dt = torch.zeros(tokens, heads, dtype=dtype)
            bc = torch.zeros(tokens, 2 * groups, state_size, dtype=dtype)
            initial = torch.arange(num_reqs) % 2 == 0
            batch = VarlenBatch(indices, initial, qsl, torch.zeros_like(indices), None, 128)

            def step(x=x, xs=xs, dt=dt, bc=bc, batch=batch, prefill=prefill, indices=indices):
                if prefill:
                    triton_conv1d.conv1d_prefill(x, conv, conv_state, batch)
                    ssd_prefill(xs, dt, bc[:, :groups], bc[:, groups:], params, ssm_state, batch)
                else:
                    triton_conv1d.conv1d_decode(x, conv, conv_state, indices)
                    triton_state_update.ssd_decode(
                        xs, dt, bc[:, :groups], bc[:, groups:], params, ssm_state, indices
                    )

            launches += record_launches(modules, step)
    return launches
