"""What the KV-cache coordinator needs to know about one request.

The scheduler owns these objects: it appends sampled tokens and advances
``num_computed_tokens`` after each step. The coordinator only reads them, except for the lazily
extended block hashes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcore.hashing import BlockHash, extend_block_hashes


class KVRequest:
    """Token ids (prompt, then output) of one request, and their prefix-cache hashes.

    ``num_computed_tokens`` is how many of the tokens already have KV in the cache; the
    scheduler sets it (to the cache hit after the first allocation, then += the tokens each step
    computed, and back to 0 on preemption). ``block_hashes`` holds one hash per full
    ``hash_block_size`` chunk and grows as tokens are appended.
    """

    __slots__ = (
        "_block_hashes",
        "cache_salt",
        "hash_block_size",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        hash_block_size: int,
        cache_salt: str | None = None,
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.cache_salt = cache_salt
        self.hash_block_size = hash_block_size
        self.num_computed_tokens = 0
        self._block_hashes: list[BlockHash] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        self.token_ids.extend(token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        """One hash per full hash unit of the tokens so far (computed on first use)."""
        hashes = self._block_hashes
        if len(self.token_ids) // self.hash_block_size > len(hashes):
            extend_block_hashes(hashes, self.token_ids, self.hash_block_size, self.cache_salt)
        return hashes

    def __repr__(self) -> str:
        return (
            f"KVRequest({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
