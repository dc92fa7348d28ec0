"""Attention KV-cache specs: full, MLA, sliding window, chunked local and circular buffer.

Page geometry of every attention spec: H head slots × N states × C content bytes, where K and V
sit side by side along C. A backend may override H and C (``num_head_slots``,
``state_content_bytes``) through its ``customize_spec`` hook, and a page may be padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import msgspec

from kvcore._math import cdiv, round_up
from kvcore.dtypes import DTypeName, KVQuantMode, dtype_size
from kvcore.errors import KVCacheSpecError, KVCacheSpecMergeError
from kvcore.spec_base import KVCacheSpec, normalize_tokens_per_state, require_positive

force_setattr = msgspec.structs.force_setattr


class AttentionSpec(KVCacheSpec, frozen=True, kw_only=True):
    num_kv_heads: int
    head_size: int
    dtype: DTypeName
    head_size_v: int | None = None  # None means "same as head_size"
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    # An int, or a fractions.Fraction (which travels on the wire as its "p/q" string).
    tokens_per_state: int | str = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        require_positive(
            owner,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            num_head_slots=self.num_head_slots,
            state_content_bytes=self.state_content_bytes,
            page_size_padded=self.page_size_padded,
        )
        dtype_size(self.dtype)  # refuses unknown names when constructed from Python
        if self.head_size_v is None:
            force_setattr(self, "head_size_v", self.head_size)
        elif self.head_size_v < 0:
            raise KVCacheSpecError(f"{owner}.head_size_v must be >= 0, got {self.head_size_v}")
        tokens_per_state = normalize_tokens_per_state(self.tokens_per_state)
        force_setattr(self, "tokens_per_state", tokens_per_state)
        if (Fraction(self.block_size) / tokens_per_state).denominator != 1:
            raise KVCacheSpecError(
                f"{owner}: block_size {self.block_size} is not a whole number of states "
                f"of {tokens_per_state} tokens each."
            )
        if (
            self.page_size_padded is not None
            and self.page_size_padded < self.unpadded_page_size_bytes
        ):
            raise KVCacheSpecError(
                f"{owner}.page_size_padded={self.page_size_padded} is smaller than the page "
                f"content of {self.unpadded_page_size_bytes} bytes."
            )

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads if self.num_head_slots is None else self.num_head_slots

    @property
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * dtype_size(self.dtype)

    @property
    def view_dtype(self) -> str:
        return self.dtype

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.num_heads * self.num_states * self.state_content_size_bytes

    real_page_size_bytes = unpadded_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


# The fields every attention spec shares; merges compare exactly these.
ATTENTION_FIELDS = AttentionSpec.__struct_fields__


def _attention_fields(spec: AttentionSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in ATTENTION_FIELDS}


def _single_value(specs: Sequence[KVCacheSpec], field: str) -> bool:
    return len({getattr(spec, field) for spec in specs}) == 1


def merge_window_sizes(windows: set[int]) -> int | None:
    if not windows:
        return None
    if len(windows) == 1:
        return next(iter(windows))
    raise KVCacheSpecMergeError(
        "All attention layers in the same KV cache group must have the same window size."
    )


class FullAttentionSpec(AttentionSpec, frozen=True, kw_only=True):
    # When the hybrid allocator is off, a local-attention layer is *managed* as full attention
    # but still *computed* with its window; these fields remember the window.
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(
            type(self).__name__,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
        )

    @classmethod
    def uniform_type_base(cls) -> type[KVCacheSpec]:
        return FullAttentionSpec

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> FullAttentionSpec:
        if not specs or not all(type(s) is FullAttentionSpec for s in specs):
            raise KVCacheSpecMergeError(
                "FullAttentionSpec.merge takes only FullAttentionSpecs "
                "(MLAAttentionSpecs merge with MLAAttentionSpec.merge)."
            )
        return _merge_full_family(FullAttentionSpec, specs, {})


def _merge_full_family(cls, specs, extra_fields: dict[str, object]):
    """Merge full-attention-family specs: windows merge, ``non_causal`` is OR-ed, and every
    attention field must agree."""
    sliding_window = merge_window_sizes(
        {s.sliding_window for s in specs if s.sliding_window is not None}
    )
    chunk = merge_window_sizes(
        {s.attention_chunk_size for s in specs if s.attention_chunk_size is not None}
    )
    if sliding_window is not None and chunk is not None:
        raise KVCacheSpecMergeError(
            "Model with both sliding window layers and chunked local attention layers "
            "is not supported."
        )
    merged = cls(
        **_attention_fields(specs[0]),
        **extra_fields,
        sliding_window=sliding_window,
        attention_chunk_size=chunk,
        non_causal=any(s.non_causal for s in specs),
    )
    expected = _attention_fields(merged)
    if any(_attention_fields(s) != expected for s in specs):
        raise KVCacheSpecMergeError(
            "All attention layers in the same KV cache group must have the same attention spec."
        )
    return merged


def _apply_alignment(spec: AttentionSpec, alignment: int | None) -> None:
    """Pad the page up to a multiple of ``alignment`` (some MLA kernels need aligned pages)."""
    if alignment is None:
        return
    require_positive(type(spec).__name__, alignment=alignment)
    real = spec.unpadded_page_size_bytes
    aligned = round_up(real, alignment)
    if aligned != real:
        force_setattr(spec, "page_size_padded", aligned)


def _copy_realigned(spec, block_size: int):
    # An aligned page is derived from the block size, so let __post_init__ recompute it.
    padded = None if spec.alignment is not None else spec.page_size_padded
    return msgspec.structs.replace(spec, block_size=block_size, page_size_padded=padded)


class MLAAttentionSpec(FullAttentionSpec, frozen=True, kw_only=True):
    """Multi-head latent attention: one latent vector per state, so V takes no room in C."""

    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None
    model_version: str | None = None
    non_causal_multi_token_decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _apply_alignment(self, self.alignment)

    def copy_with_new_block_size(self, block_size: int) -> MLAAttentionSpec:
        return _copy_realigned(self, block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> MLAAttentionSpec:
        if not specs or not all(isinstance(s, MLAAttentionSpec) for s in specs):
            raise KVCacheSpecMergeError("MLAAttentionSpec.merge takes only MLAAttentionSpecs.")
        if not all(
            _single_value(specs, f)
            for f in ("cache_dtype_str", "tokens_per_state", "model_version")
        ):
            raise KVCacheSpecMergeError(
                "All attention layers in the same KV cache group must use the same "
                "quantization method, tokens per state, and model version."
            )
        if not _single_value(specs, "non_causal_multi_token_decode"):
            raise KVCacheSpecMergeError(
                "All MLA layers in the same KV cache group must agree on "
                "non_causal_multi_token_decode."
            )
        first = specs[0]
        extra = {
            "cache_dtype_str": first.cache_dtype_str,
            "alignment": first.alignment,
            "model_version": first.model_version,
            "non_causal_multi_token_decode": first.non_causal_multi_token_decode,
        }
        return _merge_full_family(MLAAttentionSpec, specs, extra)


class SlidingWindowSpec(AttentionSpec, frozen=True, kw_only=True):
    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(type(self).__name__, sliding_window=self.sliding_window)
        if self.extra_retained_tokens < 0:
            raise KVCacheSpecError("SlidingWindowSpec.extra_retained_tokens must be >= 0")

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Blocks one request can hold at once. The ``+ 1`` is there because the window need
        not start on a block boundary."""
        window_tokens = self.sliding_window - 1 + self.extra_retained_tokens
        tokens = min(window_tokens + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes

    def is_uniform_with_collection(self, specs: Sequence[KVCacheSpec]) -> bool:
        return all(type(s) is type(self) and s.sliding_window == self.sliding_window for s in specs)


class SlidingWindowMLASpec(SlidingWindowSpec, frozen=True, kw_only=True):
    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None
    model_version: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_version not in (None, "deepseek_v4"):
            raise KVCacheSpecError(
                "SlidingWindowMLASpec.model_version must be None or 'deepseek_v4', "
                f"got {self.model_version!r}"
            )
        _apply_alignment(self, self.alignment)

    def copy_with_new_block_size(self, block_size: int) -> SlidingWindowMLASpec:
        return _copy_realigned(self, block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> SlidingWindowMLASpec:
        if not specs or not all(isinstance(s, SlidingWindowMLASpec) for s in specs):
            raise KVCacheSpecMergeError(
                "SlidingWindowMLASpec.merge takes only SlidingWindowMLASpecs."
            )
        fields = (
            "cache_dtype_str",
            "tokens_per_state",
            "model_version",
            "sliding_window",
            "extra_retained_tokens",
        )
        if not all(_single_value(specs, f) for f in fields):
            raise KVCacheSpecMergeError(
                "All sliding-window MLA layers in the same KV cache group must use the same "
                "quantization method, tokens per state, model version, window and "
                "extra retained tokens."
            )
        return super().merge(specs)


class ChunkedLocalAttentionSpec(AttentionSpec, frozen=True, kw_only=True):
    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(type(self).__name__, attention_chunk_size=self.attention_chunk_size)

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes

    def is_uniform_with_collection(self, specs: Sequence[KVCacheSpec]) -> bool:
        return all(
            type(s) is type(self) and s.attention_chunk_size == self.attention_chunk_size
            for s in specs
        )


class CircularBufferSpec(AttentionSpec, frozen=True, kw_only=True):
    """A per-request ring holding the raw keys of the token group still being compressed.
    ``block_size`` is the ring's capacity; a request holds exactly one block."""

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.page_size_bytes

    def max_num_blocks_per_req(self, max_len: int) -> int:
        return 1
