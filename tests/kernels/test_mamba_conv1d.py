"""Causal conv1d (+ SiLU) of both Mamba backends against a per-token float64 loop.

A batch mixes a single token, fewer new tokens than the K-1 state rows, and longer prompts, with
and without initial states. States live in a strided view of a larger int8 buffer (slots spaced
apart and offset, as kvcore lays them out), slots are shuffled, and every slot the step should
write, and every output, starts as NaN: anything left unwritten fails.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.mamba import ConvWeights, VarlenBatch, get_mamba_backend
from tests.kernels.cases import DEVICE, strided_state

BACKENDS = ("torch", "triton")
NUM_SLOTS = 12
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


pytestmark = pytest.mark.usefixtures("poison_new_outputs")


@dataclass
class ConvBatch:
    x: torch.Tensor  # [T, D]
    weight: torch.Tensor  # [D, K]
    bias: torch.Tensor | None
    conv_state: torch.Tensor  # [S, K-1, D], strided
    slots: torch.Tensor  # [R] int32
    has_initial: torch.Tensor  # [R] bool
    query_start_loc: torch.Tensor  # [R+1] int32
    checkpoints: torch.Tensor  # [M, 3] int32: (request, tokens consumed, slot)

    def conv(self) -> ConvWeights:
        return ConvWeights(self.weight, self.bias)

    def varlen(self) -> VarlenBatch:
        return VarlenBatch(
            self.slots, self.has_initial, self.query_start_loc, checkpoints=self.checkpoints
        )


def make_batch(query_lens, has_initial, dim=24, width=4, dtype=torch.float32, checkpoints=(),
               with_bias=True, seed=0) -> ConvBatch:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)  # noqa: E731
    num_reqs = len(query_lens)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_reqs].to(DEVICE, torch.int32)
    conv_state = strided_state((NUM_SLOTS, width - 1, dim), dtype)
    conv_state.copy_(rand(NUM_SLOTS, width - 1, dim))
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(DEVICE, torch.int32)
    return ConvBatch(
        x=rand(sum(query_lens), dim), weight=rand(dim, width) * 0.5,
        bias=rand(dim) if with_bias else None, conv_state=conv_state, slots=slots,
        has_initial=torch.tensor(has_initial, device=DEVICE), query_start_loc=starts,
        checkpoints=torch.tensor(checkpoints, dtype=torch.int32, device=DEVICE).view(-1, 3),
    )  # fmt: skip


def expected_prefill(batch: ConvBatch):
    """(out [T, D], {slot: state [K-1, D]}) by a float64 loop over tokens."""
    weight = batch.weight.double().cpu()
    bias = batch.bias.double().cpu() if batch.bias is not None else torch.zeros(len(weight))
    history = weight.shape[1] - 1
    outs, states = [], {}
    starts = batch.query_start_loc.tolist()
    for r, (begin, end) in enumerate(itertools.pairwise(starts)):
        slot = int(batch.slots[r])
        seq = batch.conv_state[slot].double().cpu().clone()
        if not batch.has_initial[r]:
            seq.zero_()
        seq = torch.cat([seq, batch.x[begin:end].double().cpu()])  # [K-1 + L, D]
        for i in range(end - begin):
            outs.append(F.silu((seq[i : i + history + 1] * weight.T).sum(0) + bias))
        for req, consumed, ckpt_slot in batch.checkpoints.tolist():
            if req == r:
                states[ckpt_slot] = seq[consumed : consumed + history]
        states[slot] = seq[-history:]
    return torch.stack(outs), states


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual = actual.double().cpu()
    assert not actual.isnan().any(), "an output or state was left unwritten"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected.to(actual), rtol=tol, atol=tol)


def run_prefill(backend: str, batch: ConvBatch):
    written = set(batch.slots.tolist()) | set(batch.checkpoints[:, 2].tolist())
    expected_out, expected_states = expected_prefill(batch)  # reads the states before the step
    for slot in set(range(NUM_SLOTS)) - {int(s) for s in batch.slots[batch.has_initial]}:
        batch.conv_state[slot] = float("nan")  # unread slots: poison, they must not leak in
    out = get_mamba_backend(backend).conv1d_prefill(
        batch.x, batch.conv(), batch.conv_state, batch.varlen()
    )
    assert out.shape == batch.x.shape and out.dtype == batch.x.dtype
    assert_close(out, expected_out, batch.x.dtype)
    assert set(expected_states) == written
    for slot, state in expected_states.items():
        assert_close(batch.conv_state[slot], state, batch.x.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [4, 2])
def test_prefill_mixed_batch(backend, width):
    # Lengths 1 and 2 are fewer than K-1 = 3 new tokens: the state keeps initial rows.
    batch = make_batch([1, 2, 7, 13, 5, 2], [True, True, False, True, False, False],
                       width=width, checkpoints=[(2, 2, 10), (3, 1, 11), (3, 8, 9)])  # fmt: skip
    batch.slots[:] = torch.tensor([3, 0, 6, 1, 7, 4], dtype=torch.int32)  # not 9, 10, 11
    run_prefill(backend, batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_bf16_without_bias(backend):
    batch = make_batch([5, 1, 9], [True, False, True], dtype=torch.bfloat16, with_bias=False,
                       checkpoints=[(2, 4, 11)], seed=1)  # fmt: skip
    run_prefill(backend, batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_shifts_each_window(backend):
    batch = make_batch([1, 1, 1, 1], [True] * 4, seed=2)
    weight, bias = batch.weight.double().cpu(), batch.bias.double().cpu()
    before = batch.conv_state[batch.slots.long()].double().cpu()  # [R, K-1, D]
    window = torch.cat([before, batch.x.double().cpu()[:, None]], dim=1)  # [R, K, D]
    expected = F.silu(torch.einsum("rkd,dk->rd", window, weight) + bias)
    others = [s for s in range(NUM_SLOTS) if s not in batch.slots.tolist()]
    untouched = batch.conv_state[others].clone()
    out = get_mamba_backend(backend).conv1d_decode(
        batch.x, batch.conv(), batch.conv_state, batch.slots
    )
    assert_close(out, expected, torch.float32)
    assert_close(batch.conv_state[batch.slots.long()], window[:, 1:], torch.float32)
    assert torch.equal(batch.conv_state[others], untouched)
