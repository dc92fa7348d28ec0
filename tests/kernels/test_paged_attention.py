"""Triton paged attention (interpreted on CPUs) vs the torch reference vs dense float64.

The matrix of the issue: every layout x {prefill only, decode only, mixed} x GQA {1, 4, 8 -> 1}
x {no window, window 13 < context} x block size {16, 32} x {bf16, fp32}. One test call owns
one cache (layout, block size, dtype, heads) and runs the three batches with and without the
window; the caches themselves cover every pair of their four values (``pairwise_matrix``), not
the whole product. Outputs start as NaN.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

import kvcore
from kernels.attention.paged_attention import paged_attention
from kernels.attention.params import AttentionParams
from kernels.attention.reference import paged_attention_reference
from tests.kernels.cases import (
    BATCHES,
    DTYPES,
    TOLERANCES,
    WINDOW,
    Batch,
    blocks_needed,
    dense_outputs,
    make_batch,
    make_cache,
    poisoned,
    relative_error,
)

HEAD_SIZE = 16
# name -> (query heads, KV heads)
HEAD_GROUPS = {"gqa1": (2, 2), "gqa4": (8, 2), "mqa8": (8, 1)}
NUM_SPARE_BLOCKS = 3


def compare_three_ways(batch: Batch, view: torch.Tensor, params: AttentionParams, dtype_name):
    """Error messages for every pair that misses the bound (empty when all agree)."""
    shape = (batch.query.shape[0], batch.query.shape[1], params.resolve_head_size_v(HEAD_SIZE))
    triton_out = paged_attention(
        batch.query, view, batch.metadata, params, out=poisoned(shape, batch.query.dtype)
    )
    torch_out = paged_attention_reference(
        batch.query, view, batch.metadata, params, out=poisoned(shape, batch.query.dtype)
    )
    dense = dense_outputs(batch, params)
    bound = TOLERANCES[dtype_name]
    errors = {
        "triton vs dense": relative_error(triton_out, dense),
        "torch vs dense": relative_error(torch_out, dense),
        "triton vs torch": relative_error(triton_out, torch_out.double()),
    }
    return [f"{pair}: {error:.3g} > {bound}" for pair, error in errors.items() if error > bound]


def pairwise_matrix() -> list[tuple[str, str, int, str]]:
    """Every pair of (layout, head grouping, block size, dtype) values meets in some case: each
    (layout, grouping) takes the next (block size, dtype) combination in a rotation of four,
    so a layout sees three of the four (both sizes and both dtypes) and a grouping sees all
    four. 18 cases in place of the full product's 72 (the interpreter makes each about 1 s)."""
    combos = [(16, "float32"), (32, "bfloat16"), (16, "bfloat16"), (32, "float32")]
    assert {dtype for _, dtype in combos} == set(DTYPES)
    return [
        (layout, heads, *combos[(i + j) % len(combos)])
        for i, layout in enumerate(kvcore.valid_layout_names())
        for j, heads in enumerate(HEAD_GROUPS)
    ]


def test_the_matrix_covers_every_pair_of_values():
    cases = pairwise_matrix()
    values = [kvcore.valid_layout_names(), list(HEAD_GROUPS), [16, 32], list(DTYPES)]
    for a, b in itertools.combinations(range(4), 2):
        met = {(case[a], case[b]) for case in cases}
        assert met == set(itertools.product(values[a], values[b])), (a, b)


@pytest.mark.parametrize(("layout", "heads", "block_size", "dtype_name"), pairwise_matrix())
def test_matrix(layout, heads, block_size, dtype_name):
    num_q_heads, num_kv_heads = HEAD_GROUPS[heads]
    spec = kvcore.FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=HEAD_SIZE, dtype=dtype_name
    )
    num_blocks = max(blocks_needed(b, block_size) for b in BATCHES.values()) + NUM_SPARE_BLOCKS
    cache = make_cache(layout, spec, num_blocks)
    cache.raw.fill_(0x7F)  # every cell nobody wrote reads as ~3e38
    generator = torch.Generator().manual_seed(zlib.crc32(f"{layout}{heads}{block_size}".encode()))
    failures = []
    for kind, requests in BATCHES.items():
        batch = make_batch(cache, requests, num_q_heads, generator)
        for window in (None, WINDOW):
            params = AttentionParams(
                scale=1 / math.sqrt(HEAD_SIZE), num_kv_heads=num_kv_heads, sliding_window=window
            )
            for message in compare_three_ways(batch, cache.view, params, dtype_name):
                failures.append(f"{kind}, window={window}: {message}")
    assert not failures, "\n".join(failures)
