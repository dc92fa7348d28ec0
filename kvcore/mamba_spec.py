"""Recurrent-state (Mamba, linear attention, conv) KV-cache spec.

A request's whole state is one cell: H = 1 head slot, N = 1 state, C = the bytes of every state
tensor laid end to end. The state does not grow with the sequence, so the page size does not
depend on the block size.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore._math import cdiv, prod
from kvcore.dtypes import DTypeName, dtype_size
from kvcore.errors import KVCacheSpecError
from kvcore.spec_base import KVCacheSpec, require_positive

MAMBA_CACHE_MODES = ("none", "all", "align")


class MambaSpec(KVCacheSpec, frozen=True, kw_only=True):
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DTypeName, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    num_heads: int = 1
    tokens_per_state: int = -1
    # True when every TP rank holds the whole state (a small conv state, say) instead of a
    # head-axis shard; such a state never shares a group with sharded ones.
    tp_replicated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise KVCacheSpecError(
                f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes."
            )
        for shape in self.shapes:
            if any(isinstance(d, bool) or d <= 0 for d in shape):
                raise KVCacheSpecError(f"MambaSpec state shape {shape} must be positive ints.")
        for name in self.dtypes:
            dtype_size(name)
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise KVCacheSpecError(
                f"MambaSpec.mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if self.num_heads != 1 or self.tokens_per_state != -1:
            raise KVCacheSpecError(
                "MambaSpec holds one state per block: num_heads must be 1 and tokens_per_state -1."
            )
        if self.num_speculative_blocks < 0 or self.num_prefill_checkpoint_blocks < 0:
            raise KVCacheSpecError("MambaSpec block counts must be >= 0.")
        require_positive("MambaSpec", page_size_padded=self.page_size_padded)
        if self.page_size_padded is not None and self.page_size_padded < self.state_bytes:
            raise KVCacheSpecError(
                f"MambaSpec.page_size_padded={self.page_size_padded} is smaller than the state "
                f"of {self.state_bytes} bytes."
            )

    @property
    def state_bytes(self) -> int:
        return sum(
            prod(shape) * dtype_size(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def state_content_size_bytes(self) -> int:
        return self.state_bytes

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.state_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes if self.page_size_padded is None else self.page_size_padded

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        page = self.page_size_bytes
        if self.mamba_cache_mode == "all":
            return (cdiv(max_model_len, self.block_size) + self.num_speculative_blocks) * page
        if self.mamba_cache_mode == "align":
            extra = self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
            return page * (2 + extra)
        return page * (1 + self.num_speculative_blocks)

    def max_num_blocks_per_req(self, max_len: int) -> int:
        if self.mamba_cache_mode == "align":
            # Rows are indexed by position in "align" mode.
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        # Only the mode-"all" bound depends on the sequence length; the step budget never does.
        return cdiv(self.max_memory_usage_bytes(max_len, 0), self.page_size_bytes)

    def is_uniform_with_collection(self, specs: Sequence[KVCacheSpec]) -> bool:
        return all(
            isinstance(s, MambaSpec)
            and s.num_speculative_blocks == self.num_speculative_blocks
            and s.num_prefill_checkpoint_blocks == self.num_prefill_checkpoint_blocks
            and s.page_size_bytes == self.page_size_bytes
            and s.tp_replicated == self.tp_replicated
            for s in specs
        )
