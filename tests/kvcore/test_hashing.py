"""Block hashing (reference §5.1): chained, seeded identically in every process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from kvcore.hashing import (
    NONE_HASH,
    BlockHashView,
    block_extra_keys,
    hash_block_tokens,
    hash_token_ids,
    hashes_for_block_size,
    make_group_key,
    split_group_key,
)
from kvcore.kv_request import KVRequest

TOKENS = list(range(100, 140))  # 40 tokens: 2 full blocks of 16, 8 left over


def test_none_hash_is_the_sha256_of_the_fixed_seed():
    assert hashlib.sha256(b"kvray-none-hash").digest() == NONE_HASH


def test_hashes_agree_across_processes_with_different_python_hash_seeds():
    code = (
        "from kvcore.hashing import hash_token_ids\n"
        "print(','.join(h.hex() for h in hash_token_ids(list(range(100, 140)), 16, 'salt')))"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        outputs.add(result.stdout.strip())
    here = ",".join(h.hex() for h in hash_token_ids(TOKENS, 16, "salt"))
    assert outputs == {here}


def test_only_full_chunks_are_hashed_and_each_hash_chains_on_its_parent():
    hashes = hash_token_ids(TOKENS, 16)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, TOKENS[:16])
    assert hashes[1] == hash_block_tokens(hashes[0], TOKENS[16:32])
    assert hashes[0] == hash_block_tokens(NONE_HASH, TOKENS[:16])


def test_a_change_in_an_early_block_changes_every_later_hash():
    changed = [*TOKENS[:3], 9999, *TOKENS[4:]]
    original, modified = hash_token_ids(TOKENS, 16), hash_token_ids(changed, 16)
    assert original[0] != modified[0]
    assert original[1] != modified[1]  # block 1's tokens are equal, its parent is not


def test_cache_salt_is_an_extra_key_of_the_first_block_only():
    assert block_extra_keys(0, "tenant-a") == ("tenant-a",)
    assert block_extra_keys(1, "tenant-a") == ()
    assert block_extra_keys(0, None) == ()
    salted = hash_token_ids(TOKENS, 16, "tenant-a")
    assert salted[0] == hash_block_tokens(None, TOKENS[:16], ("tenant-a",))
    assert salted[1] == hash_block_tokens(salted[0], TOKENS[16:32])
    assert salted[0] != hash_token_ids(TOKENS, 16)[0]
    assert salted[0] != hash_token_ids(TOKENS, 16, "tenant-b")[0]


def test_extra_keys_are_length_prefixed():
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1], ())


def test_group_keys_append_four_big_endian_bytes():
    block_hash = hash_token_ids(TOKENS, 16)[0]
    key = make_group_key(block_hash, 258)
    assert key == block_hash + b"\x00\x00\x01\x02"
    assert split_group_key(key) == (block_hash, 258)


def test_coarser_view_takes_the_last_fine_hash_of_each_coarse_block():
    view = BlockHashView([b"A", b"B", b"C", b"D", b"E"], 16, 32)
    assert len(view) == 2
    assert list(view) == [b"B", b"D"]
    assert (view[0], view[1], view[-1]) == (b"B", b"D", b"D")
    assert view[0:2] == [b"B", b"D"]
    with pytest.raises(IndexError):
        view[2]


def test_a_view_follows_its_growing_list():
    hashes = [b"A", b"B", b"C"]
    view = BlockHashView(hashes, 4, 8)
    assert list(view) == [b"B"]
    hashes.append(b"D")
    assert list(view) == [b"B", b"D"]


def test_hashes_for_block_size_returns_the_list_itself_at_equal_sizes():
    hashes = [b"A", b"B"]
    assert hashes_for_block_size(hashes, 16, 16) is hashes
    assert list(hashes_for_block_size(hashes, 16, 32)) == [b"B"]
    with pytest.raises(ValueError, match="not a multiple"):
        hashes_for_block_size(hashes, 16, 24)


def test_request_hashes_grow_lazily_as_tokens_arrive():
    request = KVRequest("r", TOKENS, hash_block_size=16, cache_salt="s")
    assert request.block_hashes == hash_token_ids(TOKENS, 16, "s")
    first_two = list(request.block_hashes)
    request.append_token_ids(range(7))  # 47 tokens: still 2 full blocks
    assert request.block_hashes == first_two
    request.append_token_ids([7])  # 48 tokens: a third block
    assert request.block_hashes[:2] == first_two
    assert request.block_hashes == hash_token_ids([*TOKENS, *range(8)], 16, "s")
    assert (request.num_tokens, request.num_prompt_tokens) == (48, 40)
