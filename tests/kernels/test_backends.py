"""The backend interface: choice by name, layout and block-size refusals, spec hook, and one
layer's forward (write, then attend) agreeing between the triton and torch backends."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvcore
from kernels import (
    AttentionParams,
    MultipleOf,
    UnknownAttentionBackendError,
    UnsupportedKVCacheError,
    attention_backend_names,
    get_attention_backend,
)
from kernels.attention.reference import dense_attention_float64, gather_request_kv
from kernels.attention.torch_backend import TorchAttentionBackend
from tests.kernels.cases import (
    BATCHES,
    DEVICE,
    blocks_needed,
    make_cache,
    randn,
    relative_error,
)

SPEC = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32")


def test_backends_by_name():
    assert attention_backend_names() == ["torch", "triton"]
    assert get_attention_backend("torch").name == "torch"
    assert get_attention_backend(" Triton ").name == "triton"


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(UnknownAttentionBackendError) as info:
        get_attention_backend("flash")
    assert str(info.value) == (
        "Unknown attention backend 'flash'. Valid backends: ['torch', 'triton']"
    )


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_every_layout_is_supported(name):
    backend = get_attention_backend(name)
    assert backend.supported_kv_cache_layouts() == tuple(kvcore.KVCacheLayout)
    assert backend.check_kv_cache_layout("nhd") is kvcore.KVCacheLayout.LBNHC
    with pytest.raises(kvcore.KVCacheLayoutError, match="Unknown KV cache layout 'XYZ'"):
        backend.check_kv_cache_layout("XYZ")


class PageOnlyBackend(TorchAttentionBackend):
    name = "page-only"

    def supported_kv_cache_layouts(self):
        return (kvcore.KVCacheLayout.LBHNC, kvcore.KVCacheLayout.LBNHC)

    def supported_kernel_block_sizes(self):
        return (16, MultipleOf(64))


def test_unsupported_layout_is_refused_by_name():
    with pytest.raises(kvcore.KVCacheLayoutError) as info:
        PageOnlyBackend().check_kv_cache_layout("bhlnc")
    assert str(info.value) == (
        "The page-only attention backend does not support KV cache layout BHLNC. "
        "Supported layouts: ['LBHNC', 'LBNHC']"
    )


def test_kernel_block_sizes():
    backend = PageOnlyBackend()
    assert [backend.check_kernel_block_size(n) for n in (16, 64, 128)] == [16, 64, 128]
    with pytest.raises(UnsupportedKVCacheError, match=r"kernel block size 32\. Supported: "):
        backend.check_kernel_block_size(32)
    assert get_attention_backend("triton").check_kernel_block_size(8) == 8


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_customize_spec_is_identity_and_refuses_quantized_caches(name):
    backend = get_attention_backend(name)
    assert backend.customize_spec(SPEC) is SPEC
    fp8 = kvcore.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype="float8_e4m3fn"
    )
    with pytest.raises(UnsupportedKVCacheError, match="dtype 'float8_e4m3fn'"):
        backend.customize_spec(fp8)


def one_layer_step(backend_name: str, layout: str):
    """A mixed step through ``forward``: new tokens written, then attended, in a cache that
    already holds every request's context."""
    backend = get_attention_backend(backend_name)
    requests = BATCHES["mixed"]
    cache = make_cache(layout, SPEC, blocks_needed(requests, 16))
    generator = torch.Generator().manual_seed(2)
    tables, next_block = [], 0
    for request in requests:
        num = -(-request.seq_len // 16)
        tables.append(list(range(next_block, next_block + num))[::-1])
        next_block += num
    seq_lens = [r.seq_len for r in requests]
    context_lens = [r.seq_len - r.query_len for r in requests]
    context = backend.build_metadata(context_lens, context_lens, tables, 16, DEVICE)
    num_context = context.num_actual_tokens
    backend.write_kv(randn((num_context, 2, 16), torch.float32, generator),
                     randn((num_context, 2, 16), torch.float32, generator),
                     cache.view, context)  # fmt: skip
    step = backend.build_metadata([r.query_len for r in requests], seq_lens, tables, 16, DEVICE)
    num_tokens = step.num_actual_tokens
    query, key, value = (randn((num_tokens, n, 16), torch.float32, generator) for n in (4, 2, 2))
    params = AttentionParams(scale=0.25, num_kv_heads=2, softcap=3.0)
    out = backend.forward(query, key, value, cache.view, step, params)
    return out, cache.raw


@pytest.mark.parametrize("layout", ["LHBNC", "BLHNC"])
def test_forward_agrees_between_backends(layout):
    triton_out, triton_raw = one_layer_step("triton", layout)
    torch_out, torch_raw = one_layer_step("torch", layout)
    assert torch.equal(triton_raw, torch_raw)
    assert (triton_out - torch_out).abs().max() <= 1e-4 * torch_out.abs().max()


def test_triton_backend_builds_anywhere_and_refuses_cpu_tensors_at_launch():
    """Construction needs no GPU (the controller plans with it); a launch on CPU tensors
    without the interpreter is refused by name instead of failing inside triton."""
    if torch.cuda.is_available():
        pytest.skip("the refusal only applies to CPU-only machines")
    code = (
        "import os; os.environ['TRITON_INTERPRET'] = '0'\n"
        "import torch\n"
        "from kernels import get_attention_backend\n"
        "backend = get_attention_backend('triton')\n"
        "step = backend.build_metadata([1], [1], [[1]], 16)\n"
        "try:\n"
        "    backend.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8),"
        " torch.zeros(2, 1, 16, 16), step)\n"
        "except RuntimeError as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "cannot run on cpu tensors: it needs a CUDA GPU, or TRITON_INTERPRET=1" in (
        result.stdout
    )


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_float32_queries_over_a_half_precision_cache(backend_name, cache_dtype):
    """--kv-cache-dtype float16/bfloat16 under a float32 model: K/V are rounded once, on the
    way into the cache, and attention over what the cache holds computes in float32 (on CPUs)
    for float32 rows. A mixed step: a chunked prefill between two decodes (SDPA and the C
    kernel on torch)."""
    backend = get_attention_backend(backend_name)
    dtype_name = str(cache_dtype).removeprefix("torch.")
    spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=dtype_name)
    requests = BATCHES["mixed"]
    cache = make_cache("BLHNC", spec, blocks_needed(requests, 16))
    generator = torch.Generator().manual_seed(5)
    tables, next_block = [], 0
    for request in requests:
        num = -(-request.seq_len // 16)
        tables.append(list(range(next_block, next_block + num)))
        next_block += num
    seq_lens = [r.seq_len for r in requests]
    whole = backend.build_metadata(seq_lens, seq_lens, tables, 16, DEVICE)
    key, value = (randn((sum(seq_lens), 2, 16), torch.float32, generator) for _ in range(2))
    backend.write_kv(key, value, cache.view, whole)
    step = backend.build_metadata([r.query_len for r in requests], seq_lens, tables, 16, DEVICE)
    query = randn((step.num_actual_tokens, 4, 16), torch.float32, generator)
    params = AttentionParams(scale=0.25, num_kv_heads=2)
    out = backend.attend(query, cache.view, step, params)
    assert out.dtype == torch.float32
    # Rounding to nearest, as torch does; the Triton interpreter truncates to bfloat16 (GPUs
    # round), so there the bound is one bfloat16 step.
    truncates = backend_name == "triton" and DEVICE.type == "cpu" and dtype_name == "bfloat16"
    step_size = torch.finfo(cache_dtype).eps * (1 if truncates else 0.5)
    starts, bounds = step.query_start_loc_cpu, whole.query_start_loc_cpu
    for i, seq_len in enumerate(seq_lens):
        cells = gather_request_kv(cache.view, torch.tensor(tables[i]), seq_len, 16, 2)
        held_key, held_value = cells[..., :16], cells[..., 16:32]
        assert held_key.dtype == cache_dtype
        stored = slice(bounds[i], bounds[i + 1])
        for held, written in ((held_key, key[stored]), (held_value, value[stored])):
            assert ((held.float() - written).abs() <= step_size * written.abs()).all()
            assert not torch.equal(held.float(), written)  # rounded, not kept in float32
        rows = slice(starts[i], starts[i + 1])
        expected = dense_attention_float64(query[rows], held_key, held_value, params)
        assert relative_error(out[rows], expected) < 1e-5
