"""Per-step metadata: exact prefix sums, block tables and slot mappings."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import metadata as metadata_module
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


@pytest.mark.parametrize("seed", range(4))
def test_the_python_loop_and_the_tensor_pass_give_the_same_slots(monkeypatch, seed):
    generator = torch.Generator().manual_seed(seed)
    num_reqs, block_size = 6, 16

    def draw(high: int) -> int:
        return int(torch.randint(1, high, (1,), generator=generator))

    seq_lens = [draw(200) for _ in range(num_reqs)]
    query_lens = [min(s, draw(4) if seed % 2 else draw(40)) for s in seq_lens]
    width = max(-(-s // block_size) for s in seq_lens) + 1
    table = torch.randint(1, 500, (num_reqs, width), generator=generator, dtype=torch.int32)
    padded = sum(query_lens) + 3
    built = {}
    for limit in (0, 10_000):  # every step by tensors, then every step by the loop
        monkeypatch.setattr(metadata_module, "LOOP_MAX_TOKENS", limit)
        built[limit] = build_attention_metadata(
            query_lens, seq_lens, table, block_size, num_tokens=padded
        )
    assert torch.equal(built[0].slot_mapping, built[10_000].slot_mapping)
    assert built[0].slot_mapping.dtype == built[10_000].slot_mapping.dtype == torch.int64
    assert built[0].slot_mapping[-3:].tolist() == [-1, -1, -1]
