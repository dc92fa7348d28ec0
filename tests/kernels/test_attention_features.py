"""The attention options outside the main matrix: kernel-block split views, soft-capping,
sinks, a V head size unlike K's, padded head slots, padded query rows, long prefill tiles."""

from __future__ import annotations

import math

import pytest
import torch

import kvcore
from kernels.attention.paged_attention import paged_attention
from kernels.attention.params import AttentionParams
from tests.kernels.cases import (
    BATCHES,
    DEVICE,
    DTYPES,
    LAYER_NAMES,
    Request,
    blocks_needed,
    dense_outputs,
    make_batch,
    make_cache,
    poisoned,
    relative_error,
)
from tests.kernels.test_paged_attention import compare_three_ways

MIXED = BATCHES["mixed"]


def run_case(layout, spec, requests, num_q_heads, params, dtype_name, **cache_kwargs):
    num_blocks = blocks_needed(requests, spec.block_size) + 2
    cache = make_cache(layout, spec, num_blocks, **cache_kwargs)
    cache.raw.fill_(0x7F)
    batch = make_batch(cache, requests, num_q_heads, torch.Generator().manual_seed(11))
    failures = compare_three_ways(batch, cache.view, params, dtype_name)
    assert not failures, "\n".join(failures)
    return cache, batch


def spec_of(dtype_name="float32", block_size=16, num_kv_heads=2, **kwargs):
    return kvcore.FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=kwargs.pop("head_size", 16),
        dtype=dtype_name,
        **kwargs,
    )


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(
    ("layout", "layer_names"),
    [("LBHNC", LAYER_NAMES), ("LBNHC", LAYER_NAMES), ("BLHNC", ["only"])],
)
def test_kernel_block_split(layout, layer_names, dtype_name):
    # Manager blocks of 32 tokens read as kernel blocks of 16 (kvcore's split view).
    spec = spec_of(dtype_name, block_size=32)
    params = AttentionParams(scale=0.25, num_kv_heads=2, sliding_window=13)
    cache, _ = run_case(
        layout, spec, MIXED, 8, params, dtype_name, kernel_block_size=16, layer_names=layer_names
    )
    assert cache.view.shape[2] == 16 and cache.view.shape[0] == 2 * cache.num_blocks


FEATURES = {
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": torch.tensor([2.0, -1.0, 0.5, 3.0, -3.0, 1.0, 0.0, 2.5])},
    "all": {"softcap": 2.0, "sinks": torch.linspace(-2, 3, 8), "sliding_window": 13},
}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_softcap_and_sinks(feature, layout, dtype_name):
    params = AttentionParams(scale=0.25, num_kv_heads=2, **FEATURES[feature])
    _, batch = run_case(layout, spec_of(dtype_name), MIXED, 8, params, dtype_name)
    # The option must matter, or agreeing with the dense oracle proves nothing.
    plain = AttentionParams(scale=0.25, num_kv_heads=2)
    assert relative_error(dense_outputs(batch, params), dense_outputs(batch, plain)) > 0.05


def test_value_head_size_differs_from_key():
    spec = spec_of(head_size=32, head_size_v=16)
    params = AttentionParams(scale=32**-0.5, num_kv_heads=2, head_size_v=16)
    run_case("LHBNC", spec, MIXED, 4, params, "float32")


def test_padded_head_slots():
    # A backend may publish more head slots than KV heads; the extra slots are never read.
    spec = spec_of(num_head_slots=4)
    params = AttentionParams(scale=0.25, num_kv_heads=2)
    cache, _ = run_case("BLNHC", spec, MIXED, 4, params, "float32")
    assert cache.view.shape[1] == 4


@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
def test_long_prefill_uses_large_tiles(layout):
    # A 70-token chunk switches the launcher to 64-row programs and 64-key tiles.
    requests = [Request(query_len=70, seq_len=90), Request(query_len=1, seq_len=33)]
    params = AttentionParams(scale=0.25, num_kv_heads=2, sliding_window=40)
    run_case(layout, spec_of("bfloat16"), requests, 8, params, "bfloat16")


def test_padding_rows_and_empty_requests_are_left_alone():
    spec = spec_of()
    requests = [Request(query_len=0, seq_len=20), *MIXED]
    cache = make_cache("LBHNC", spec, blocks_needed(requests, 16))
    batch = make_batch(cache, requests, 2, torch.Generator().manual_seed(5))
    num_tokens = batch.query.shape[0]
    padded_query = torch.cat(
        [batch.query, torch.randn(3, 2, 16, device=DEVICE)]
    )  # three padding rows
    out = poisoned((num_tokens + 3, 2, 16), torch.float32)
    params = AttentionParams(scale=1 / math.sqrt(16), num_kv_heads=2)
    paged_attention(padded_query, cache.view, batch.metadata, params, out=out)
    assert out[num_tokens:].isnan().all()
    assert relative_error(out[:num_tokens], dense_outputs(batch, params)) <= 1e-4
