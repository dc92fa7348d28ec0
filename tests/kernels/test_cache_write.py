"""Cache writes land on exactly the right bytes of the raw buffer, in every layout.

The expected bytes are computed from kvcore's byte strides alone (no views), so a writer that
goes through the view's strides wrongly, touches another layer, or writes a padding token
changes a byte the test compares.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kernels.attention.cache_write import write_kv
from kernels.attention.reference import write_kv_reference
from tests.kernels.cases import DEVICE, DTYPES, LAYER_NAMES, make_cache, randn

WRITERS = {"triton": write_kv, "torch": write_kv_reference}


def expected_raw(raw, spec, layout, num_blocks, layer_names, key, value, slot_mapping, kbs=None):
    """``raw`` with each real token's K and V bytes placed by byte-stride arithmetic, in
    blocks of ``kbs`` tokens (kernel blocks) if given, else of the spec's block size."""
    kbs = kbs or spec.block_size
    strides = kvcore.compute_layout_strides(spec, num_blocks, len(layer_names), layout, kbs)
    layer_stride, block_stride, head_stride, state_stride, _ = strides
    tensor = kvcore.build_kv_cache_tensor(spec, layer_names, num_blocks, layout)
    itemsize = key.element_size()
    expected, key, value = raw.cpu().clone(), key.cpu(), value.cpu()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, kbs)
        for head in range(spec.num_kv_heads):
            cell = torch.cat([key[token, head], value[token, head]])  # [C] elements
            start = (
                tensor.offset
                + (len(layer_names) - 1) * layer_stride
                + block * block_stride
                + head * head_stride
                + offset * state_stride
            )
            expected[start : start + cell.numel() * itemsize] = cell.view(torch.int8)
    return expected


def random_slots(num_tokens, num_slots, num_padding, generator) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=generator)[:num_padding]] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", kvcore.valid_layout_names())
def test_write_reads_back_raw_bytes(layout, dtype_name, writer):
    spec = kvcore.FullAttentionSpec(
        block_size=16, num_kv_heads=3, head_size=16, head_size_v=8, dtype=dtype_name
    )
    num_blocks = 4
    cache = make_cache(layout, spec, num_blocks)
    generator = torch.Generator().manual_seed(7)
    cache.raw.copy_(
        torch.randint(-128, 128, cache.raw.shape, generator=generator, dtype=torch.int8)
    )
    before = cache.raw.clone()
    key = randn((20, 3, 16), DTYPES[dtype_name], generator)
    value = randn((20, 3, 8), DTYPES[dtype_name], generator)
    slots = random_slots(20, num_blocks * 16, 5, generator)
    WRITERS[writer](key, value, cache.view, slots)
    expected = expected_raw(before, spec, layout, num_blocks, LAYER_NAMES, key, value, slots)
    assert torch.equal(cache.raw.cpu(), expected)


@pytest.mark.parametrize(
    ("layout", "layer_names"),
    [("LBHNC", LAYER_NAMES), ("LBNHC", LAYER_NAMES), ("BLHNC", ["only"])],
)
def test_write_through_kernel_block_split(layout, layer_names):
    # Manager blocks of 32 read as kernel blocks of 16: manager block b, offset o is kernel
    # block 2b + o // 16, row o % 16, and a kernel block is a page of its own (in LBHNC its
    # heads are 16 rows apart, not 32).
    spec = kvcore.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype="float32")
    cache = make_cache(layout, spec, 3, kernel_block_size=16, layer_names=layer_names)
    assert cache.view.shape[:3] == (6, 2, 16)
    generator = torch.Generator().manual_seed(3)
    before = cache.raw.clone()
    key = randn((40, 2, 16), torch.float32, generator)
    value = randn((40, 2, 16), torch.float32, generator)
    slots = random_slots(40, 3 * 32, 4, generator)
    write_kv(key, value, cache.view, slots)
    expected = expected_raw(before, spec, layout, 3, layer_names, key, value, slots, 16)
    assert torch.equal(cache.raw.cpu(), expected)


def test_write_refuses_mismatched_shapes():
    spec = kvcore.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32")
    view = make_cache("LBHNC", spec, 2).view
    key, slots = torch.zeros(4, 2, 16, device=DEVICE), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="must agree on tokens and heads"):
        write_kv(key, torch.zeros(4, 2, 16, device=DEVICE), view, slots[:3])
    with pytest.raises(ValueError, match="fewer than K \\(16\\) \\+ V \\(32\\)"):
        write_kv(key, torch.zeros(4, 2, 32, device=DEVICE), view, slots)
