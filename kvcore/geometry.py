"""Shape and stride arithmetic of the 5-D KV cache ``[L, B, H, N, C]``, in bytes.

Everything here is pure integer math on specs, so the controller can plan without torch and a
worker can check that its views address exactly the bytes the plan gave it.
"""

from __future__ import annotations

from fractions import Fraction

import msgspec

from kvcore._math import prod
from kvcore.errors import KVCacheGeometryError
from kvcore.layout import B, KVCacheLayout, L
from kvcore.spec_base import KVCacheSpec

Strides = tuple[int, int, int, int, int]
NO_FIXED_STRIDES: tuple[None, ...] = (None,) * 5


class KVCacheTensor(msgspec.Struct):
    """One group's window onto the single backing allocation.

    The page of layer ``layers[l]``, block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride``. ``size`` is the size of the whole backing
    allocation, which every tensor of a config shares; tensors of different groups may overlap
    because a block id belongs to one group at a time.
    """

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise KVCacheGeometryError("KVCacheTensor needs at least one layer.")
        if self.layer_stride <= 0 or self.block_stride <= 0:
            raise KVCacheGeometryError(
                f"KVCacheTensor strides must be positive, got layer_stride={self.layer_stride}, "
                f"block_stride={self.block_stride}."
            )
        if self.offset < 0 or self.size <= self.offset:
            raise KVCacheGeometryError(
                f"KVCacheTensor offset {self.offset} must lie inside its allocation of "
                f"{self.size} bytes."
            )


def compute_layer_kv_cache_shape_bytes(
    spec: KVCacheSpec, num_blocks: int, kernel_block_size: int | None = None
) -> tuple[int, int, int, int]:
    """``(B, H, N, C)`` of one layer: B in kernel blocks, N in kernel states, C in bytes."""
    kernel_block_size = kernel_block_size or spec.block_size
    if spec.block_size % kernel_block_size != 0:
        raise KVCacheGeometryError(
            f"Kernel block size {kernel_block_size} must divide KV cache block size "
            f"{spec.block_size}."
        )
    tokens_per_state = spec.tokens_per_state
    if tokens_per_state > 0 and (Fraction(kernel_block_size) / tokens_per_state).denominator != 1:
        raise KVCacheGeometryError(
            f"Kernel block size {kernel_block_size} is not a whole number of states of "
            f"{tokens_per_state} tokens each."
        )
    return (
        num_blocks * (spec.block_size // kernel_block_size),
        spec.num_heads,
        spec.get_num_kernel_states(kernel_block_size),
        spec.state_content_size_bytes,
    )


def compute_layout_strides(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    layout: KVCacheLayout | str,
    kernel_block_size: int | None = None,
    fixed_strides: tuple[int | None, ...] = NO_FIXED_STRIDES,
) -> Strides:
    """Byte strides in logical order ``(L, B, H, N, C)``.

    Axes are laid out innermost first in the layout's physical order. A fixed stride replaces
    the computed one and every axis outside it is scaled from the fixed value. A padded page is
    applied at the outermost axis of the page tail, which must be L or B.
    """
    layout = KVCacheLayout.parse(layout)
    if len(fixed_strides) != 5 or any(s is not None and s <= 0 for s in fixed_strides):
        raise KVCacheGeometryError(
            f"fixed_strides must be 5 entries, each None or positive; got {fixed_strides}"
        )
    shape = (num_layers, *compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block_size))
    order = layout.stride_order
    padded = getattr(spec, "page_size_padded", None)
    page_grid_end = None
    if padded is not None:
        if kernel_block_size not in (None, spec.block_size):
            raise KVCacheGeometryError("Padded KV pages do not support kernel block splitting.")
        page_grid_end = max(order.index(L), order.index(B)) + 1
        grid_axes = order[:page_grid_end]
        if prod(shape[d] for d in grid_axes) != num_layers * num_blocks:
            raise KVCacheGeometryError(
                "Page padding requires dimensions outside the page tail to be L, B, or "
                f"singleton; got {layout.name} with shape {shape}"
            )
    strides: list[int] = [0] * 5
    cur = 1
    for position in reversed(range(5)):
        dim = order[position]
        if page_grid_end is not None and position == page_grid_end - 1:
            cur = max(cur, padded)
            if cur % padded != 0:
                raise KVCacheGeometryError(
                    f"Page tail of {cur} bytes is not a multiple of the padded page {padded}."
                )
        strides[dim] = fixed_strides[dim] or cur
        cur = strides[dim] * shape[dim]
    return tuple(strides)


def build_kv_cache_tensor(
    spec: KVCacheSpec,
    layers: list[str],
    num_blocks: int,
    layout: KVCacheLayout | str,
    *,
    block_stride: int | None = None,
    offset: int = 0,
    size: int | None = None,
) -> KVCacheTensor:
    """The tensor for ``layers`` (all of ``spec``) laid out alone, or inside a packed block of
    ``block_stride`` bytes at ``offset``. ``size`` defaults to the bytes this tensor reaches."""
    fixed = (None, block_stride, None, None, None)
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout, fixed_strides=fixed)
    if size is None:
        shape = (len(layers), *compute_layer_kv_cache_shape_bytes(spec, num_blocks))
        size = offset + max_byte_extent(shape, strides)
    return KVCacheTensor(
        size=size,
        layers=list(layers),
        layer_stride=strides[L],
        block_stride=strides[B],
        offset=offset,
    )


def max_byte_extent(shape, strides) -> int:
    """Bytes from the first to one past the last byte addressed by ``shape`` over ``strides``."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
