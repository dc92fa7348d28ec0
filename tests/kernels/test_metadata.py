"""Per-step metadata: exact prefix sums, block tables and slot mappings."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.metadata import build_attention_metadata


def test_exact_slots_with_padding():
    # Request 0: a fresh 3-token prefill in block 7. Request 1: decode of its 18th token,
    # which sits in its second block (5) at offset 1. Two padding tokens follow.
    metadata = build_attention_metadata([3, 1], [3, 18], [[7], [2, 5]], 16, num_tokens=6)
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert metadata.seq_lens.tolist() == [3, 18]
    assert metadata.block_table.tolist() == [[7, 0], [2, 5]]
    assert metadata.slot_mapping.tolist() == [112, 113, 114, 81, -1, -1]
    assert metadata.slot_mapping.dtype == torch.int64
    assert (metadata.max_query_len, metadata.max_seq_len) == (3, 18)
    assert (metadata.num_reqs, metadata.num_actual_tokens) == (2, 4)
    assert not metadata.is_decode_only


def test_decode_only_batch():
    metadata = build_attention_metadata([1, 1], [5, 40], [[0], [3, 1, 2]], 16)
    assert metadata.is_decode_only
    assert metadata.slot_mapping.tolist() == [4, 2 * 16 + 7]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([4], [3], [[0]], 16), "need 0 <= query_len <= seq_len, got 4 and 3"),
        (([1], [33], [[0, 1]], 16), "33 tokens need 3 blocks of 16, but its block table has 2"),
        (([1, 1], [3], [[0]], 16), "one entry per request; got 2, 1 and 1"),
        (([1], [3], [[0]], 0), "block_size must be positive"),
    ],
)
def test_bad_batches_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(*args)


def test_padding_cannot_shrink_the_batch():
    with pytest.raises(ValueError, match="num_tokens=1 is less than the 2 query tokens"):
        build_attention_metadata([2], [2], [[0]], 16, num_tokens=1)
