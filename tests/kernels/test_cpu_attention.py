"""The torch backend's fast CPU paths (the C decode kernel, and SDPA over gathered pages for
prefill chunks) against dense float64 attention.

Every layout x {prefill, decode, mixed} x GQA {1, 4, 8 -> 1} x {fp32, bf16, fp16} x
{no feature, window, softcap, sinks}, and a view split into kernel blocks smaller than the
manager's. Outputs start as NaN, so a row the backend forgets fails. Without a C compiler the
backend must still serve, through the reference.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kernels.attention import cpu_attention
from kernels.attention.metadata import build_attention_metadata
from kernels.attention.params import AttentionParams
from kernels.attention.torch_backend import TorchAttentionBackend
from tests.kernels.cases import (
    BATCHES,
    WINDOW,
    Batch,
    Request,
    blocks_needed,
    dense_outputs,
    make_batch,
    make_cache,
    poisoned,
    relative_error,
)
from tests.kernels.test_paged_attention import HEAD_GROUPS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
HEAD_SIZE, HEAD_SIZE_V = 16, 16


def features(num_q_heads: int) -> dict[str, dict]:
    sinks = torch.linspace(-1.0, 2.0, num_q_heads)
    return {"plain": {}, "window": {"sliding_window": WINDOW}, "softcap": {"softcap": 2.5},
            "sinks": {"sinks": sinks}}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def kernel_is_built():
    if cpu_attention.decode_kernel() is None:
        pytest.fail("the CPU decode kernel did not build (a C compiler is part of CI)")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", [layout.name for layout in kvcore.KVCacheLayout])
def test_fast_paths_match_dense_attention(layout, dtype_name):
    backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(hash((layout, dtype_name)) % 2**31)
    failures = []
    for group_name, (num_q_heads, num_kv_heads) in HEAD_GROUPS.items():
        spec = kvcore.FullAttentionSpec(
            block_size=16, num_kv_heads=num_kv_heads, head_size=HEAD_SIZE, dtype=dtype_name
        )
        num_blocks = max(blocks_needed(r, 16) for r in BATCHES.values()) + 2
        cache = make_cache(layout, spec, num_blocks)
        for batch_name, requests in BATCHES.items():
            batch = make_batch(cache, requests, num_q_heads, generator)
            for feature, extra in features(num_q_heads).items():
                params = AttentionParams(scale=0.25, num_kv_heads=num_kv_heads, **extra)
                shape = (batch.query.shape[0], num_q_heads, HEAD_SIZE_V)
                unwritten = poisoned(shape, batch.query.dtype)
                out = backend.attend(batch.query, cache.view, batch.metadata, params, unwritten)
                error = relative_error(out, dense_outputs(batch, params))
                if error > TOLERANCES[dtype_name]:
                    failures.append(f"{group_name}/{batch_name}/{feature}: {error:.2e}")
    assert failures == []


@pytest.mark.parametrize("head_size", [64, 48, 40])
def test_decode_at_model_head_sizes_matches_dense_attention(head_size):
    """Head sizes of 16k take the kernel's AVX-512 loop where the CPU has it (64: the common
    one, 48: not a power of two); 40 takes the portable one. Decode and mixed batches, every
    feature but softcap (which the portable loop serves), float32."""
    backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(head_size)
    failures = []
    for group_name, (num_q_heads, num_kv_heads) in HEAD_GROUPS.items():
        spec = kvcore.FullAttentionSpec(
            block_size=16, num_kv_heads=num_kv_heads, head_size=head_size, dtype="float32"
        )
        num_blocks = max(blocks_needed(r, 16) for r in BATCHES.values()) + 2
        cache = make_cache("LBHNC", spec, num_blocks)
        for batch_name in ("decode", "mixed"):
            batch = make_batch(cache, BATCHES[batch_name], num_q_heads, generator)
            for feature, extra in features(num_q_heads).items():
                params = AttentionParams(scale=head_size**-0.5, num_kv_heads=num_kv_heads, **extra)
                shape = (batch.query.shape[0], num_q_heads, head_size)
                unwritten = poisoned(shape, batch.query.dtype)
                out = backend.attend(batch.query, cache.view, batch.metadata, params, unwritten)
                error = relative_error(out, dense_outputs(batch, params))
                if error > TOLERANCES["float32"]:
                    failures.append(f"{group_name}/{batch_name}/{feature}: {error:.2e}")
    assert failures == []


THREAD_BATCHES = {
    "one key": [Request(query_len=1, seq_len=1)],
    "two keys": [Request(query_len=1, seq_len=2)],
    "one long": [Request(query_len=1, seq_len=70)],
    "twelve": [Request(query_len=1, seq_len=3 + 7 * i) for i in range(12)],
}


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
def test_decode_over_any_number_of_threads_matches_dense_attention(num_threads):
    """An item (request, KV head) of 32 keys or more goes into parts, up to one a thread,
    whose softmax states are merged after; shorter ones stay whole. At each thread count:
    fewer keys than threads, one long request, and twelve of mixed lengths; the sink counted
    once, the window cut inside a part; float32 (the AVX-512 loop) and float16 (the portable
    one)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(num_threads)
    failures = []
    try:
        for dtype_name in ("float32", "float16"):
            for group_name, (num_q_heads, num_kv_heads) in HEAD_GROUPS.items():
                spec = kvcore.FullAttentionSpec(
                    block_size=16, num_kv_heads=num_kv_heads, head_size=64, dtype=dtype_name
                )
                num_blocks = max(blocks_needed(r, 16) for r in THREAD_BATCHES.values()) + 2
                cache = make_cache("LBHNC", spec, num_blocks)
                for batch_name, requests in THREAD_BATCHES.items():
                    batch = make_batch(cache, requests, num_q_heads, generator)
                    for feature in ("plain", "window", "sinks"):
                        extra = features(num_q_heads)[feature]
                        params = AttentionParams(scale=0.125, num_kv_heads=num_kv_heads, **extra)
                        shape = (batch.query.shape[0], num_q_heads, 64)
                        unwritten = poisoned(shape, batch.query.dtype)
                        out = backend.attend(
                            batch.query, cache.view, batch.metadata, params, unwritten
                        )
                        error = relative_error(out, dense_outputs(batch, params))
                        if error > TOLERANCES[dtype_name]:
                            failures.append(
                                f"{dtype_name}/{group_name}/{batch_name}/{feature}: {error:.2e}"
                            )
    finally:
        torch.set_num_threads(previous)
    assert failures == []


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kernel_block_split_views(layout):
    """Manager blocks of 16 tokens over kernel blocks of 4: slots map through both."""
    spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32")
    cache = make_cache(layout, spec, 12, kernel_block_size=4)
    assert cache.view.shape[2] == 4
    batch = make_batch(cache, BATCHES["mixed"], 4, torch.Generator().manual_seed(3))
    params = AttentionParams(scale=0.25, num_kv_heads=2)
    unwritten = poisoned((batch.query.shape[0], 4, 16), torch.float32)
    out = TorchAttentionBackend().attend(batch.query, cache.view, batch.metadata, params, unwritten)
    assert relative_error(out, dense_outputs(batch, params)) < 1e-5


def test_without_a_compiler_the_backend_serves_through_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_attention, "decode_kernel", lambda: None)
    monkeypatch.setattr("kernels.attention.torch_backend.decode_kernel", lambda: None)
    spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32")
    cache = make_cache("BLHNC", spec, 12)
    batch = make_batch(cache, BATCHES["decode"], 4, torch.Generator().manual_seed(4))
    params = AttentionParams(scale=0.25, num_kv_heads=2)
    unwritten = poisoned((batch.query.shape[0], 4, 16), torch.float32)
    out = TorchAttentionBackend().attend(batch.query, cache.view, batch.metadata, params, unwritten)
    assert relative_error(out, dense_outputs(batch, params)) < 1e-5


def test_a_missing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached library to fall back on
    cpu_attention.decode_kernel.cache_clear()
    try:
        assert cpu_attention.decode_kernel() is None
    finally:
        cpu_attention.decode_kernel.cache_clear()


def test_the_built_kernel_is_reused_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_attention._build()
    stamp = first.stat().st_mtime_ns
    assert cpu_attention._build() == first and first.stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "kvray"


def batch_of(batch: Batch, indices: list[int]) -> Batch:
    """The decode requests ``indices`` of ``batch`` as a batch of their own, over the same
    cache blocks."""
    seq_lens = [batch.metadata.seq_lens_cpu[i] for i in indices]
    tables = batch.metadata.block_table[indices].contiguous()
    metadata = build_attention_metadata([1] * len(indices), seq_lens, tables, 16)
    keys = [batch.keys[i] for i in indices]
    values = [batch.values[i] for i in indices]
    return Batch(metadata, batch.query[indices].contiguous(), keys, values)


def test_a_request_reads_the_same_attention_whatever_runs_beside_it():
    """How the kernel splits an item's keys depends on the item alone: one request's output
    is bitwise the same decoded alone, beside eleven others, and as the middle row of a
    batch (a speculative verification's rows, a plain decode step and a full batch agree)."""
    backend = TorchAttentionBackend()
    spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype="float32")
    requests = [Request(query_len=1, seq_len=40 + 13 * i) for i in range(12)]
    cache = make_cache("LBHNC", spec, blocks_needed(requests, 16) + 2)
    generator = torch.Generator().manual_seed(5)
    batch = make_batch(cache, requests, 9, generator)
    params = AttentionParams(scale=0.125, num_kv_heads=3)
    together = backend.attend(batch.query, cache.view, batch.metadata, params, poisoned(
        (12, 9, 64), torch.float32))  # fmt: skip
    for index in (0, 5, 11):
        alone = batch_of(batch, [index])
        out = backend.attend(alone.query, cache.view, alone.metadata, params, poisoned(
            (1, 9, 64), torch.float32))  # fmt: skip
        assert torch.equal(out[0], together[index])
    three = batch_of(batch, [4, 5, 6])
    out = backend.attend(three.query, cache.view, three.metadata, params, poisoned(
        (3, 9, 64), torch.float32))  # fmt: skip
    assert torch.equal(out[1], together[5])
