"""The root of the KV-cache spec tree.

A spec describes the geometry of one layer's KV cache: how many tokens a block holds, and how a
block's page divides into head slots (H), states (N) and content bytes (C). Specs are frozen
msgspec Structs: hashable, comparable field by field, and encodable as a tagged union (see
``kvcore.wire``), so every rank and the controller can agree on them byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import msgspec

from kvcore._math import cdiv
from kvcore.errors import KVCacheSpecError, KVCacheSpecMergeError


def normalize_tokens_per_state(value: object, *, allow_stateful: bool = False) -> int | Fraction:
    """Validate ``tokens_per_state`` and bring its wire form back to a Python number.

    A positive int means one state compresses that many tokens; a Fraction ``1/k`` means k states
    per token. On the wire a Fraction travels as its ``"p/q"`` string. ``-1`` (allowed only for
    recurrent state specs) means one state per block regardless of its token count.
    """
    if isinstance(value, bool):
        raise KVCacheSpecError(f"tokens_per_state must be an int or a Fraction, got {value!r}")
    if isinstance(value, str):
        try:
            value = Fraction(value)
        except (ValueError, ZeroDivisionError):
            raise KVCacheSpecError(f"tokens_per_state {value!r} is not a fraction") from None
    if not isinstance(value, int | Fraction):
        raise KVCacheSpecError(
            f"tokens_per_state must be an int or a Fraction, got {type(value).__name__}"
        )
    if value > 0 or (allow_stateful and value == -1):
        return value
    raise KVCacheSpecError(f"tokens_per_state must be positive, got {value}")


def require_positive(owner: str, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise KVCacheSpecError(f"{owner}.{name} must be a positive int, got {value!r}")


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of every spec. ``block_size`` is the number of tokens in one manager block.

    Subclasses define the page geometry: ``num_heads`` (H), ``tokens_per_state`` (which sets N)
    and ``state_content_size_bytes`` (C).
    """

    block_size: int

    def __post_init__(self) -> None:
        require_positive(type(self).__name__, block_size=self.block_size)

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def num_heads(self) -> int:
        raise NotImplementedError

    @property
    def tokens_per_state(self) -> int | Fraction:
        raise NotImplementedError

    @property
    def state_content_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def view_dtype(self) -> str | None:
        """The element type a layer's view is read as; None keeps raw bytes."""
        return None

    @property
    def num_states(self) -> int:
        return self.get_num_kernel_states(self.block_size)

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """States in a block of ``kernel_block_size`` tokens (``16 // Fraction(1, 4) == 64``)."""
        tokens_per_state = self.tokens_per_state
        if tokens_per_state > 0:
            return int(kernel_block_size // tokens_per_state)
        return 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Bytes one request can need at most, given the longest sequence and the step budget."""
        raise NotImplementedError

    def max_num_blocks_per_req(self, max_len: int) -> int:
        """Width of a request's block-table row for sequences up to ``max_len`` tokens."""
        return cdiv(max_len, self.block_size)

    def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
        return msgspec.structs.replace(self, block_size=block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """One spec for a group of layers; by default the layers must have identical specs."""
        if not specs:
            raise KVCacheSpecMergeError("Cannot merge an empty list of KV cache specs.")
        first = specs[0]
        if any(spec != first for spec in specs):
            raise KVCacheSpecMergeError("All layers in the same KV cache group must be the same.")
        return first

    @classmethod
    def uniform_type_base(cls) -> type[KVCacheSpec]:
        """The family a spec may share a uniform-type group with (see UniformTypeKVCacheSpecs)."""
        return cls

    def is_uniform_with_collection(self, specs: Sequence[KVCacheSpec]) -> bool:
        base = self.uniform_type_base()
        return all(isinstance(spec, base) for spec in specs)
