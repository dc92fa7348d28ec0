"""Prefix-cache block hashes: chained sha256 over token ids.

A block's hash covers its whole prefix: ``hash(parent hash, this block's token ids, extra
keys)``, where the first block's parent is ``NONE_HASH``. The seed is fixed (no random or
per-process value), so the controller, a restarted controller and any tool compute the same
hashes for the same tokens. Only full ``hash_block_size`` chunks are hashed.

Extra keys: ``cache_salt`` goes into the first block only, so requests with different salts share
nothing (a salt isolates tenants) while one salt still shares every later block of its prefix.

A group whose block is ``k`` hash units long sees the coarser view ``BlockHashView``: its entry i
is the hash of unit ``(i + 1) * k - 1`` (the last unit of block i), because a unit's hash already
covers everything before it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

BlockHash = bytes

HASH_SEED = b"kvray-none-hash"
# The parent of the first block. Fixed, so hashes agree across processes and restarts.
NONE_HASH: BlockHash = hashlib.sha256(HASH_SEED).digest()

GROUP_ID_NUM_BYTES = 4


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """The hash of one block given its parent's hash (None for the first block).

    Every field is length-prefixed, so no two different inputs share a byte stream.
    """
    digest = hashlib.sha256(NONE_HASH if parent is None else parent)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        data = key.encode()
        digest.update(len(data).to_bytes(4, "little"))
        digest.update(data)
    return digest.digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[str, ...]:
    """Extra keys of block ``block_index``: the salt, on the first block only."""
    if cache_salt is not None and block_index == 0:
        return (cache_salt,)
    return ()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    hash_block_size: int,
    cache_salt: str | None = None,
) -> None:
    """Append the hashes of every full chunk of ``token_ids`` not yet in ``block_hashes``."""
    num_full = len(token_ids) // hash_block_size
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_full):
        start = index * hash_block_size
        chunk = token_ids[start : start + hash_block_size]
        parent = hash_block_tokens(parent, chunk, block_extra_keys(index, cache_salt))
        block_hashes.append(parent)


def hash_token_ids(
    token_ids: Sequence[int], hash_block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The hashes of every full chunk of ``token_ids``."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, hash_block_size, cache_salt)
    return hashes


def make_group_key(block_hash: BlockHash, group_id: int) -> bytes:
    """The prefix-map key of a block of one KV-cache group: the hash, then 4 big-endian bytes."""
    return block_hash + group_id.to_bytes(GROUP_ID_NUM_BYTES, "big")


def split_group_key(key: bytes) -> tuple[BlockHash, int]:
    """Inverse of ``make_group_key``."""
    return key[:-GROUP_ID_NUM_BYTES], int.from_bytes(key[-GROUP_ID_NUM_BYTES:], "big")


class BlockHashView(Sequence[BlockHash]):
    """A lazy view of fine hashes at a coarser block size (hash 16, block 32: [A, B, C, D] ->
    [B, D]). Only whole coarse blocks are visible."""

    __slots__ = ("_hashes", "_scale")

    def __init__(self, hashes: Sequence[BlockHash], hash_block_size: int, block_size: int):
        if block_size % hash_block_size != 0:
            raise ValueError(
                f"block size {block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        self._hashes = hashes
        self._scale = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("BlockHashView index out of range")
        return self._hashes[(index + 1) * self._scale - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        scale = self._scale
        return iter(self._hashes[scale - 1 : len(self) * scale : scale])


def hashes_for_block_size(
    hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """``hashes`` (one per hash unit) as seen by a group of ``block_size`` tokens."""
    if block_size == hash_block_size:
        return hashes
    return BlockHashView(hashes, hash_block_size, block_size)
