"""The Mamba-2 SSD scan of both backends against a per-token float64 recurrence.

Prefill batches mix a single token, prompts shorter than a chunk, non-multiples of the chunk
size and prompts of several chunks, with and without initial states, starting mid-chunk
(``start_positions``), at chunk sizes 4 and 16, with one and two groups, and write checkpoints at
every chunk boundary they can. States live in a strided view of an int8 buffer; every slot
the step writes, and every slot it must not read, starts as NaN.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.mamba import SSDParams, VarlenBatch, get_mamba_backend
from tests.kernels.cases import DEVICE, strided_state

BACKENDS = ("torch", "triton")
NUM_SLOTS = 24
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.usefixtures("poison_new_outputs")

# A token; 3 new tokens mid-chunk; 9 and 17 (no multiple of 4 or 16); 40, several chunks.
QUERY_LENS = [1, 3, 9, 17, 2, 40]
HAS_INITIAL = [True, False, True, False, True, True]
START_POSITIONS = [5, 0, 3, 0, 7, 14]


@dataclass
class SSDBatch:
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H]
    A: torch.Tensor  # [H]
    B: torch.Tensor  # [T, G, N]
    C: torch.Tensor  # [T, G, N]
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    ssm_state: torch.Tensor  # [S, H, P, N], strided
    slots: torch.Tensor  # [R] int32
    has_initial: torch.Tensor  # [R] bool
    query_start_loc: torch.Tensor  # [R+1] int32
    start_positions: torch.Tensor  # [R] int32
    checkpoints: torch.Tensor  # [M, 3] int32
    dt_min: float = 0.0

    def args(self) -> tuple:
        return (self.x, self.dt, self.A, self.B, self.C, self.D, self.dt_bias, self.ssm_state)

    def params(self, dt_min: float | None = None) -> SSDParams:
        dt_min = self.dt_min if dt_min is None else dt_min
        return SSDParams(self.A, self.D, self.dt_bias, dt_min)

    def varlen(self, chunk_size: int) -> VarlenBatch:
        return VarlenBatch(
            self.slots, self.has_initial, self.query_start_loc, self.start_positions,
            self.checkpoints, chunk_size,
        )  # fmt: skip


def make_batch(query_lens=QUERY_LENS, has_initial=HAS_INITIAL, start_positions=START_POSITIONS,
               chunk_size=4, num_groups=2, dtype=torch.float32, state_dtype=torch.float32,
               dt_min=0.0, num_heads=4, head_dim=8, state_size=16, seed=0) -> SSDBatch:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    num_tokens, num_reqs = sum(query_lens), len(query_lens)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_reqs]
    spare = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    checkpoints = []  # up to three chunk ends inside each prompt, and some prompts' last token
    for r, (start, length) in enumerate(zip(start_positions, query_lens, strict=True)):
        ends = [n for n in range(1, length + 1) if (start + n) % chunk_size == 0]
        checkpoints += [(r, n, spare.pop()) for n in ends[:3] + ([length] if r % 2 else [])]
    if checkpoints:  # one chunk end copied to two slots
        checkpoints.append((*checkpoints[-1][:2], spare.pop()))
    ssm_state = strided_state((NUM_SLOTS, num_heads, head_dim, state_size), state_dtype)
    ssm_state.copy_(rand(*ssm_state.shape) * 0.5)
    on_device = lambda t, dt=dtype: t.to(DEVICE, dt)  # noqa: E731
    return SSDBatch(
        x=on_device(rand(num_tokens, num_heads, head_dim)),
        dt=on_device(rand(num_tokens, num_heads)),
        A=on_device(-torch.exp(rand(num_heads) * 0.5), torch.float32),
        B=on_device(rand(num_tokens, num_groups, state_size)),
        C=on_device(rand(num_tokens, num_groups, state_size)),
        D=on_device(rand(num_heads)), dt_bias=on_device(rand(num_heads) - 1.0),
        ssm_state=ssm_state, slots=on_device(slots, torch.int32),
        has_initial=torch.tensor(has_initial, device=DEVICE),
        query_start_loc=on_device(torch.tensor([0, *query_lens]).cumsum(0), torch.int32),
        start_positions=on_device(torch.tensor(start_positions), torch.int32),
        checkpoints=on_device(torch.tensor(checkpoints).view(-1, 3), torch.int32), dt_min=dt_min,
    )  # fmt: skip


def recurrence_step(h, x, dt, A, B, C, D, dt_bias, dt_min):
    """One token of every head in float64: h [H, P, N], x [H, P], dt [H], B/C [G, N]."""
    num_heads, num_groups = x.shape[0], B.shape[0]
    group = torch.arange(num_heads) // (num_heads // num_groups)
    dt = F.softplus(dt + dt_bias).clamp_min(dt_min)  # [H]
    h = torch.exp(dt * A)[:, None, None] * h + (dt[:, None] * x)[..., None] * B[group][:, None]
    return h, torch.einsum("hpn,hn->hp", h, C[group]) + D[:, None] * x


def expected_prefill(batch: SSDBatch):
    """(y [T, H, P], {slot: state}) by a float64 loop over every request's tokens."""
    x, dt, A, B, C, D, dt_bias, ssm_state = (t.double().cpu() for t in batch.args())
    starts = batch.query_start_loc.tolist()
    ys, states = [], {}
    for r, (begin, end) in enumerate(itertools.pairwise(starts)):
        h = ssm_state[int(batch.slots[r])].clone()
        if not batch.has_initial[r]:
            h.zero_()
        for t in range(begin, end):
            h, y = recurrence_step(h, x[t], dt[t], A, B[t], C[t], D, dt_bias, batch.dt_min)
            ys.append(y)
            for req, consumed, slot in batch.checkpoints.tolist():
                if req == r and consumed == t + 1 - begin:
                    states[slot] = h
        states[int(batch.slots[r])] = h
    return torch.stack(ys), states


def assert_close(actual, expected, dtype) -> None:
    actual = actual.double().cpu()
    assert not actual.isnan().any(), "an output or state was left unwritten"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected.to(actual), rtol=tol, atol=tol)


def run_prefill(backend: str, batch: SSDBatch, chunk_size: int) -> None:
    expected_y, expected_states = expected_prefill(batch)  # reads the states before the step
    read = {int(s) for s in batch.slots[batch.has_initial]}
    for slot in set(range(NUM_SLOTS)) - read:
        batch.ssm_state[slot] = float("nan")
    y = get_mamba_backend(backend).ssd_prefill(
        batch.x, batch.dt, batch.B, batch.C, batch.params(), batch.ssm_state,
        batch.varlen(chunk_size),
    )  # fmt: skip
    assert y.shape == batch.x.shape and y.dtype == batch.x.dtype
    assert_close(y, expected_y, batch.x.dtype)
    for slot, state in expected_states.items():
        assert_close(batch.ssm_state[slot], state, batch.ssm_state.dtype)
    written = set(batch.slots.tolist()) | set(batch.checkpoints[:, 2].tolist())
    assert set(expected_states) == written
    untouched = batch.ssm_state[sorted(set(range(NUM_SLOTS)) - written)]
    assert untouched.isnan().all(), "a slot outside the step was written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("num_groups", [1, 2])
def test_prefill_mixed_batch(backend, chunk_size, num_groups):
    batch = make_batch(chunk_size=chunk_size, num_groups=num_groups, seed=chunk_size + num_groups)
    assert batch.checkpoints.shape[0] >= 4
    run_prefill(backend, batch, chunk_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_dt_min_clamps(backend):
    batch = make_batch(chunk_size=8, dt_min=0.3, seed=7)
    softplus = F.softplus(batch.dt.float() + batch.dt_bias.float())
    assert 0.2 < (softplus < 0.3).float().mean() < 0.8  # the clamp changes many steps
    run_prefill(backend, batch, chunk_size=8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_prefill_bf16_inputs(backend, state_dtype):
    batch = make_batch([6, 11, 1], [True, False, True], [2, 0, 9], chunk_size=4,
                       dtype=torch.bfloat16, state_dtype=state_dtype, seed=3)  # fmt: skip
    run_prefill(backend, batch, chunk_size=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_in_chunks_of_one_token_checkpoints_after_every_token(backend):
    """How a request verifying drafts is scanned: each token its own chunk, so the state
    after any of them can be kept (a rejected draft's successor state)."""
    batch = make_batch([4, 2, 5], [True, True, False], [9, 30, 0], chunk_size=1, seed=13)
    assert sorted(map(tuple, batch.checkpoints[:, :2].tolist()))[:3] == [(0, 1), (0, 2), (0, 3)]
    run_prefill(backend, batch, chunk_size=1)


def test_prefill_refuses_checkpoints_off_chunk_ends():
    batch = make_batch([9], [False], [0], chunk_size=4)
    batch.checkpoints = torch.tensor([[0, 5, 20]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="do not end a chunk"):
        run_prefill("torch", batch, chunk_size=4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_groups,dt_min", [(1, 0.0), (2, 0.3)])
def test_decode_steps(backend, num_groups, dt_min):
    """Three decode steps of four requests carry on the per-token recurrence in place."""
    batch = make_batch([1, 1, 1, 1], [True] * 4, [0] * 4, num_groups=num_groups, dt_min=dt_min,
                       seed=11)  # fmt: skip
    slots = batch.slots.long()
    others = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    untouched = batch.ssm_state[others].clone()
    states = [batch.ssm_state[s].double().cpu() for s in slots.tolist()]
    backend = get_mamba_backend(backend)
    for step in range(3):
        step_batch = make_batch([1, 1, 1, 1], [True] * 4, [0] * 4, num_groups=num_groups,
                                seed=20 + step)  # fmt: skip
        x, dt, _, B, C, *_ = step_batch.args()
        y = backend.ssd_decode(x, dt, B, C, batch.params(dt_min), batch.ssm_state,
                               batch.slots)  # fmt: skip
        params = [t.double().cpu() for t in (batch.A, batch.D, batch.dt_bias)]
        for r in range(4):
            states[r], expected = recurrence_step(
                states[r], x[r].double().cpu(), dt[r].double().cpu(), params[0],
                B[r].double().cpu(), C[r].double().cpu(), params[1], params[2], dt_min,
            )  # fmt: skip
            assert_close(y[r], expected, torch.float32)
            assert_close(batch.ssm_state[int(slots[r])], states[r], torch.float32)
    assert torch.equal(batch.ssm_state[others], untouched)
