"""The latent cache write lands on exactly the right bytes of the raw buffer, in every layout.

The cache is a real kvcore allocation of an ``MLAAttentionSpec`` (one head, ``L + R``
elements per token) for two layers, prefilled with random bytes; the expected buffer is built
from kvcore's byte strides alone (``test_cache_write.expected_raw``, with ``[kv_c | k_pe]`` as
the one head's K and no V). A writer that skips a real token, writes a -1 slot, touches the
other layer or goes through a stride wrongly changes a byte the test compares.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kernels.mla import get_mla_backend
from tests.kernels.cases import DEVICE, DTYPES, LAYER_NAMES, make_cache, randn
from tests.kernels.test_cache_write import expected_raw, random_slots

BACKENDS = ("torch", "triton")
LATENT_SIZE, ROPE_SIZE = 16, 8


def latent_spec(dtype_name: str, block_size: int = 4) -> kvcore.MLAAttentionSpec:
    return kvcore.MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=LATENT_SIZE + ROPE_SIZE,
        dtype=dtype_name,
    )  # fmt: skip


def write_and_expect(backend, spec, layout, num_blocks, num_tokens, num_padding, seed=7,
                     kernel_block_size=None, layer_names=LAYER_NAMES, as_3d=False):  # fmt: skip
    """Writes random latents through ``backend``; returns (raw after, raw expected)."""
    cache = make_cache(layout, spec, num_blocks, kernel_block_size, layer_names)
    generator = torch.Generator().manual_seed(seed)
    cache.raw.copy_(
        torch.randint(-128, 128, cache.raw.shape, generator=generator, dtype=torch.int8)
    )
    before = cache.raw.clone()
    dtype = cache.view.dtype
    kv_c = randn((num_tokens, LATENT_SIZE), dtype, generator)
    k_pe = randn((num_tokens, ROPE_SIZE), dtype, generator)
    slots = random_slots(num_tokens, num_blocks * spec.block_size, num_padding, generator)
    view = cache.view[:, 0] if as_3d else cache.view  # [B, N, C] is upstream's shape
    get_mla_backend(backend).write_latent(kv_c, k_pe, view, slots)
    cell = torch.cat([kv_c, k_pe], dim=1)[:, None, :]  # [T, 1, L + R]: the one head's "K"
    no_value = cell[..., :0]
    expected = expected_raw(before, spec, layout, num_blocks, layer_names, cell, no_value, slots,
                            kernel_block_size)  # fmt: skip
    return cache.raw.cpu(), expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", kvcore.valid_layout_names())
def test_write_reads_back_raw_bytes(layout, dtype_name, backend):
    actual, expected = write_and_expect(backend, latent_spec(dtype_name), layout, 6, 18, 5)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_through_3d_view_and_kernel_block_split(backend):
    # Manager blocks of 16 read as kernel blocks of 8, through upstream's [B, N, C] shape.
    spec = latent_spec("float32", block_size=16)
    actual, expected = write_and_expect(backend, spec, "LBHNC", 3, 30, 4, seed=3,
                                        kernel_block_size=8, as_3d=True)  # fmt: skip
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_writes_nothing(backend):
    spec = latent_spec("bfloat16")
    actual, expected = write_and_expect(backend, spec, "BLHNC", 4, 6, 6)
    assert torch.equal(actual, expected)


def test_write_accepts_strided_inputs():
    # kv_c and k_pe as column slices of one [T, L + R] projection, as the model produces them.
    spec = latent_spec("float32")
    cache = make_cache("BHLNC", spec, 4)
    generator = torch.Generator().manual_seed(1)
    fused = randn((10, LATENT_SIZE + ROPE_SIZE), torch.float32, generator)
    slots = torch.arange(10, device=DEVICE) * 3 % 16
    get_mla_backend("triton").write_latent(
        fused[:, :LATENT_SIZE], fused[:, LATENT_SIZE:], cache.view, slots
    )
    stored = cache.view[slots // 4, 0, slots % 4]  # [T, L + R]
    assert torch.equal(stored, fused)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_refuses_mismatched_shapes(backend):
    view = make_cache("LBHNC", latent_spec("float32"), 2).view
    write = get_mla_backend(backend).write_latent
    kv_c, k_pe = torch.zeros(4, 16, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    slots = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="must agree on tokens"):
        write(kv_c, k_pe, view, slots[:3])
    with pytest.raises(ValueError, match="fewer than the latent \\(16\\) \\+ rope \\(16\\)"):
        write(kv_c, torch.zeros(4, 16, device=DEVICE), view, slots)
    with pytest.raises(ValueError, match="must be \\[T, L\\] and k_pe \\[T, R\\]"):
        write(kv_c[:, None], k_pe, view, slots)
