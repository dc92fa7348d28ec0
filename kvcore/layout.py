"""The six physical layouts of the logical KV-cache tensor ``[L, B, H, N, C]``.

A layout's value is the physical order of the logical axes, outermost first (L=0, B=1, H=2,
N=3, C=4). Layouts only permute strides; every kernel reads the cache through strides, so a
layout is a planning decision and never a code path.
"""

from __future__ import annotations

import enum

from kvcore.errors import KVCacheLayoutError

L, B, H, N, C = range(5)

# Historical names for the two layer-outermost layouts, kept for users coming from other engines.
LAYOUT_ALIASES: dict[str, str] = {"NHD": "LBNHC", "HND": "LBHNC"}


class KVCacheLayout(enum.Enum):
    # Enum order is significant: it breaks ties during layout resolution.
    LBHNC = (L, B, H, N, C)
    LBNHC = (L, B, N, H, C)
    LHBNC = (L, H, B, N, C)
    BLHNC = (B, L, H, N, C)
    BLNHC = (B, L, N, H, C)
    BHLNC = (B, H, L, N, C)

    @classmethod
    def parse(cls, name: str | KVCacheLayout) -> KVCacheLayout:
        """The layout called ``name`` (case-insensitive; ``NHD``/``HND`` aliases accepted)."""
        if isinstance(name, KVCacheLayout):
            return name
        if not isinstance(name, str):
            raise KVCacheLayoutError(
                f"KV cache layout must be a name, got {type(name).__name__}. "
                f"Valid layouts: {valid_layout_names()}"
            )
        key = name.strip().upper()
        key = LAYOUT_ALIASES.get(key, key)
        try:
            return cls[key]
        except KeyError:
            raise KVCacheLayoutError(
                f"Unknown KV cache layout '{name}'. Valid layouts: {valid_layout_names()} "
                f"(aliases: NHD -> LBNHC, HND -> LBHNC)"
            ) from None

    @property
    def stride_order(self) -> tuple[int, ...]:
        return self.value

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """Physical order of the per-layer 4-D view ``[B, H, N, C]`` (L dropped, indices - 1)."""
        return tuple(axis - 1 for axis in self.value if axis != L)

    @property
    def is_layer_compact(self) -> bool:
        """L is outermost: every layer owns one contiguous region."""
        return self.value[0] == L

    @property
    def is_block_contiguous(self) -> bool:
        """The innermost three axes are exactly H, N, C."""
        return self.value[2:] == (H, N, C)

    @property
    def is_block_compact(self) -> bool:
        """The outer two axes are L and B, so every page is one contiguous byte run."""
        return set(self.value[:2]) == {L, B}

    @property
    def is_block_outermost(self) -> bool:
        """B is outermost: one block of every layer is one contiguous region."""
        return self.value[0] == B


def valid_layout_names() -> list[str]:
    return [layout.name for layout in KVCacheLayout]
