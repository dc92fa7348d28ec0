"""Absorbed MLA decode against naive multi-head attention, and Triton against the torch reference.

The oracle is the model's math without the trick: per head, keys ``[c W_UK^T | k_pe]`` and values
``c W_UV`` built from the latents, attended by
``kernels.attention.reference.dense_attention_float64``. The absorbed path projects the nope
query into latent space, decodes over the paged latent cache and projects the result through
``W_UV``; in float64 the two agree to rounding. The Triton kernel
then must match the torch reference in float32 (and bf16) over kvcore's block- and
layer-outermost MLA views, with uneven contexts (1..70 tokens, so some splits are empty) and 1-3
splits. Outputs, and the kernel's split workspace, start as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kvcore
from kernels.attention.metadata import build_attention_metadata
from kernels.attention.params import AttentionParams
from kernels.attention.reference import dense_attention_float64
from kernels.mla import get_mla_backend, triton_decode
from kernels.mla.reference import write_latent_reference
from tests.kernels.cases import DEVICE, make_cache, poisoned, relative_error

pytestmark = pytest.mark.usefixtures("poison_new_outputs", "poison_split_workspace")

ROPE_SIZE, NOPE_SIZE, V_SIZE = 8, 12, 10  # Rd, P, V: all different, as the issue asks
SEQ_LENS = [1, 70, 5, 33, 16, 47]  # uneven: one token, several 32-key tiles, block edges


@pytest.fixture
def poison_split_workspace(monkeypatch):
    """Stage 1 must write every per-split element stage 2 reads."""
    new_workspace = triton_decode.new_split_workspace

    def poisoned_workspace(*args):
        return tuple(t.fill_(float("nan")) for t in new_workspace(*args))

    monkeypatch.setattr(triton_decode, "new_split_workspace", poisoned_workspace)


@dataclass
class LatentBatch:
    latents: list[torch.Tensor]  # per request [S, L], as stored
    rope_keys: list[torch.Tensor]  # per request [S, Rd], as stored
    q_nope: torch.Tensor  # [R, Hq, P]
    q_pe: torch.Tensor  # [R, Hq, Rd]
    w_uk: torch.Tensor  # [Hq, P, L]
    w_uv: torch.Tensor  # [Hq, L, V]
    block_table: torch.Tensor  # [R, W] int32
    seq_lens: torch.Tensor  # [R] int32

    @property
    def q_latent(self) -> torch.Tensor:
        return torch.einsum("rhp,hpl->rhl", self.q_nope, self.w_uk)  # absorb W_UK

    @property
    def scale(self) -> float:
        return (NOPE_SIZE + ROPE_SIZE) ** -0.5


def fill_cache(view, num_blocks, block_size, num_heads, latent_size, dtype, seed) -> LatentBatch:
    """Random latents written into ``view`` (reference writer) for shuffled, disjoint blocks."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0):
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * std).to(dtype)

    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for seq_len in SEQ_LENS:
        num = -(-seq_len // block_size)
        tables.append(block_ids[:num])
        block_ids = block_ids[num:]
    whole = build_attention_metadata(SEQ_LENS, SEQ_LENS, tables, block_size, DEVICE)
    num_tokens, num_reqs = sum(SEQ_LENS), len(SEQ_LENS)
    latent, rope = rand(num_tokens, latent_size), rand(num_tokens, ROPE_SIZE)
    write_latent_reference(latent.to(DEVICE), rope.to(DEVICE), view, whole.slot_mapping)
    bounds = whole.query_start_loc_cpu
    return LatentBatch(
        latents=[latent[bounds[i] : bounds[i + 1]] for i in range(num_reqs)],
        rope_keys=[rope[bounds[i] : bounds[i + 1]] for i in range(num_reqs)],
        q_nope=rand(num_reqs, num_heads, NOPE_SIZE),
        q_pe=rand(num_reqs, num_heads, ROPE_SIZE),
        w_uk=rand(num_heads, NOPE_SIZE, latent_size, std=NOPE_SIZE**-0.5),
        w_uv=rand(num_heads, latent_size, V_SIZE, std=latent_size**-0.5),
        block_table=whole.block_table,
        seq_lens=whole.seq_lens,
    )


def naive_attention(batch: LatentBatch) -> torch.Tensor:
    """Multi-head attention with decompressed keys and values: ``[R, Hq, V]`` in float64."""
    w_uk, w_uv = batch.w_uk.double(), batch.w_uv.double()
    num_heads = w_uk.shape[0]
    params = AttentionParams(scale=batch.scale, num_kv_heads=num_heads, head_size_v=V_SIZE)
    outs = []
    for i, (latent, rope) in enumerate(zip(batch.latents, batch.rope_keys, strict=True)):
        latent, rope = latent.double(), rope.double()
        k_nope = torch.einsum("sl,hpl->shp", latent, w_uk)  # [S, Hq, P]
        k_rope = rope[:, None, :].expand(-1, num_heads, -1)  # one rope key for every head
        key = torch.cat([k_nope, k_rope], dim=-1)  # [S, Hq, P + Rd]
        value = torch.einsum("sl,hlv->shv", latent, w_uv)  # [S, Hq, V]
        query = torch.cat([batch.q_nope[i], batch.q_pe[i]], dim=-1).double()[None]  # [1, Hq, D]
        outs.append(dense_attention_float64(query, key, value, params)[0])
    return torch.stack(outs)


def decode(backend: str, batch: LatentBatch, view, block_size, num_splits, out=None):
    return get_mla_backend(backend).decode(
        batch.q_latent.to(DEVICE), batch.q_pe.to(DEVICE), view, batch.block_table,
        batch.seq_lens, block_size, batch.scale, num_splits, out,
    )  # fmt: skip


def strided_float64_view(num_blocks, block_size, latent_size) -> torch.Tensor:
    """``[B, 1, N, L + Rd]`` float64 inside a bigger buffer: another layer's cells between
    blocks and 3 spare elements after each row (kvcore has no float64 caches)."""
    width = latent_size + ROPE_SIZE
    buffer = torch.zeros(num_blocks, 2, block_size, width + 3, dtype=torch.float64, device=DEVICE)
    return buffer[:, 1:, :, :width]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("latent_size", [16, 32])
@pytest.mark.parametrize("num_heads", [1, 4])
def test_absorbed_decode_equals_naive_attention_float64(num_heads, latent_size, block_size):
    num_blocks = 2 * sum(-(-s // block_size) for s in SEQ_LENS)
    view = strided_float64_view(num_blocks, block_size, latent_size)
    batch = fill_cache(view, num_blocks, block_size, num_heads, latent_size, torch.float64, 11)
    out = decode("torch", batch, view, block_size, num_splits=1)
    assert out.dtype == torch.float64
    absorbed = torch.einsum("rhl,hlv->rhv", out.cpu(), batch.w_uv)  # back through W_UV
    assert relative_error(absorbed, naive_attention(batch)) < 1e-12


# (layout, Hq, L, manager block, kernel block, splits): each value meets the others somewhere.
TRITON_CASES = [
    ("BLHNC", 1, 16, 4, None, 1),
    ("BLHNC", 4, 32, 16, None, 3),
    ("LBHNC", 4, 16, 16, 8, 2),
    ("LBHNC", 1, 32, 4, None, 3),
    ("BHLNC", 4, 32, 4, None, 2),
]


@pytest.mark.parametrize(("layout", "num_heads", "latent_size", "block_size", "kbs", "splits"),
                         TRITON_CASES)  # fmt: skip
def test_triton_matches_reference_float32(layout, num_heads, latent_size, block_size, kbs, splits):
    spec = kvcore.MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                   head_size=latent_size + ROPE_SIZE, dtype="float32")  # fmt: skip
    num_blocks = 2 * sum(-(-s // block_size) for s in SEQ_LENS)
    cache = make_cache(layout, spec, num_blocks, kernel_block_size=kbs)
    batch = fill_cache(cache.view, num_blocks, block_size, num_heads, latent_size,
                       torch.float32, seed=splits)  # fmt: skip
    expected = decode("torch", batch, cache.view, block_size, 1)
    actual = decode("triton", batch, cache.view, block_size, splits)
    assert relative_error(actual, expected) < 1e-5
    absorbed = torch.einsum("rhl,hlv->rhv", actual.cpu().double(), batch.w_uv.double())
    assert relative_error(absorbed, naive_attention(batch)) < 1e-4


def test_triton_bfloat16_into_strided_out():
    # bf16 cache and queries; the result goes into a poisoned, strided slice of a bigger buffer.
    block_size, latent_size, num_heads = 16, 32, 4
    spec = kvcore.MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                   head_size=latent_size + ROPE_SIZE, dtype="bfloat16")  # fmt: skip
    num_blocks = sum(-(-s // block_size) for s in SEQ_LENS) + 2
    cache = make_cache("BLNHC", spec, num_blocks)
    batch = fill_cache(cache.view, num_blocks, block_size, num_heads, latent_size,
                       torch.bfloat16, seed=5)  # fmt: skip
    buffer = poisoned((len(SEQ_LENS), num_heads + 1, latent_size + 4), torch.bfloat16)
    out = buffer[:, 1:, 2 : 2 + latent_size]
    result = decode("triton", batch, cache.view, block_size, 3, out=out)
    assert result.data_ptr() == out.data_ptr()
    expected = decode("torch", batch, cache.view, block_size, 1)
    assert relative_error(out, expected) < 2e-2
    assert buffer[:, 0].isnan().all() and buffer[:, :, :2].isnan().all()  # nothing else written


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_context_gives_zeros(backend):
    # A padded decode row (seq_len 0) yields zeros, not NaN, and reads no block.
    view = torch.ones(2, 1, 4, 16 + ROPE_SIZE, device=DEVICE)
    q_latent = torch.ones(2, 4, 16, device=DEVICE)
    q_pe = torch.ones(2, 4, ROPE_SIZE, device=DEVICE)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    out = get_mla_backend(backend).decode(q_latent, q_pe, view, table, seq_lens, 4, 0.5, 2)
    assert torch.equal(out[0], torch.zeros(4, 16, device=DEVICE))
    assert torch.equal(out[1], torch.ones(4, 16, device=DEVICE))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_refuses_mismatched_shapes(backend):
    decode_fn = get_mla_backend(backend).decode
    view = torch.zeros(2, 1, 4, 16 + ROPE_SIZE, device=DEVICE)
    q_latent, q_pe = torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(2, 4, 8, device=DEVICE)
    table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="same R and Hq"):
        decode_fn(q_latent, q_pe[:, :2], view, table, seq_lens, 4, 1.0)
    with pytest.raises(ValueError, match="2 requests need seq_lens"):
        decode_fn(q_latent, q_pe, view, table, seq_lens[:1], 4, 1.0)
    with pytest.raises(ValueError, match="fewer than the latent \\(16\\) \\+ rope \\(16\\)"):
        decode_fn(q_latent, torch.zeros(2, 4, 16, device=DEVICE), view, table, seq_lens, 4, 1.0)
    with pytest.raises(ValueError, match="num_splits must be positive"):
        decode_fn(q_latent, q_pe, view, table, seq_lens, 4, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="must be contiguous"):
        every_other = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)[:, ::2]
        decode_fn(q_latent, q_pe, view, every_other, seq_lens, 4, 1.0)
