"""The mixture-of-experts kernels against a float64 oracle (each token's chosen experts run one
by one in float64 and summed by their router weights): the torch reference and the Triton fused
kernel, over uneven shapes (hidden and intermediate sizes off the kernel's tiles, one token and
many, experts left with no token); expert parallelism's ids of experts held elsewhere add
nothing; the ranks' partial sums (slices of every expert, or whole experts) add up to the
whole. New buffers start as NaN, so a row the kernel leaves unwritten fails. Router ties go
where transformers sends them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe.reference import ExpertKind, grouped_experts, select_experts
from kernels.moe.triton_moe import align_by_expert, fused_experts
from tests.kernels.cases import DEVICE, DTYPES, TOLERANCES


@pytest.fixture(autouse=True)
def poison_new_buffers(monkeypatch):
    """Every float tensor made with ``torch.empty`` (the kernel's intermediate rows) starts
    as NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)


def oracle(hidden, w13, w2, weights, ids, gated=True) -> torch.Tensor:
    """Each token's experts one by one, in float64; ids past the experts add nothing. Gated:
    SiLU(gate) * up; ungated: relu²(up)."""
    hidden, w13, w2, weights = (t.double() for t in (hidden, w13, w2, weights))
    out = torch.zeros_like(hidden)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= w13.shape[0]:
                continue
            if gated:
                gate, up = w13[e, :inter] @ hidden[t], w13[e, inter:] @ hidden[t]
                inner = F.silu(gate) * up
            else:
                inner = F.relu(w13[e] @ hidden[t]) ** 2
            out[t] += weights[t, j] * (w2[e] @ inner)
    return out


def problem(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    x = rand(num_tokens, hidden)
    w13, w2 = rand(num_experts, 2 * inter, hidden) * 0.2, rand(num_experts, hidden, inter) * 0.2
    logits = rand(num_tokens, num_experts)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def relative(a, b) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


SHAPES = [
    # tokens, experts, top_k, hidden, intermediate
    (1, 4, 2, 48, 40),
    (37, 5, 2, 48, 40),
    (64, 8, 3, 96, 72),
    (3, 16, 2, 32, 16),  # most experts get no token
]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_float64(shape):
    x, w13, w2, weights, ids = problem(*shape, torch.float32)
    expected = oracle(x, w13, w2, weights, ids)
    assert relative(grouped_experts(x, w13, w2, weights, ids), expected) < 1e-5


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernel_matches_float64(shape, dtype_name):
    x, w13, w2, weights, ids = problem(*shape, DTYPES[dtype_name])
    expected = oracle(x, w13, w2, weights, ids)
    assert relative(fused_experts(x, w13, w2, weights, ids), expected) < TOLERANCES[dtype_name]


@pytest.mark.parametrize("kernel", [grouped_experts, fused_experts])
@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_ungated_relu2_experts_match_float64(kernel, shape):
    """NemotronH's experts: relu²(up x), no gate rows."""
    x, w13, w2, weights, ids = problem(*shape, torch.float32)
    up = w13[:, w2.shape[2] :].contiguous()
    expected = oracle(x, up, w2, weights, ids, gated=False)
    out = kernel(x, up, w2, weights, ids, kind=ExpertKind(gated=False, activation="relu2"))
    assert relative(out, expected) < 1e-5


def swiglu_oai_oracle(hidden, w13, w2, b13, b2, weights, ids, alpha=1.702, limit=7.0):
    """gpt-oss's experts in float64: biases, then (clamp(up) + 1) * g * sigmoid(alpha g)."""
    hidden, w13, w2, b13, b2, weights = (t.double() for t in (hidden, w13, w2, b13, b2, weights))
    out = torch.zeros_like(hidden)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            projected = w13[e] @ hidden[t] + b13[e]
            gate = projected[:inter].clamp(max=limit)
            up = projected[inter:].clamp(-limit, limit)
            inner = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += weights[t, j] * (w2[e] @ inner + b2[e])
    return out


@pytest.mark.parametrize("kernel", [grouped_experts, fused_experts])
@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_biased_clamped_swiglu_experts_match_float64(kernel, shape):
    """gpt-oss's experts; weights scaled up so the clamps at +-7 bite."""
    x, w13, w2, weights, ids = problem(*shape, torch.float32)
    w13 = w13 * 20
    num_experts, hidden, inter = w2.shape
    b13 = torch.randn(num_experts, 2 * inter).to(DEVICE)
    b2 = torch.randn(num_experts, hidden).to(DEVICE)
    gate = torch.einsum("eih,th->tei", w13[:, :inter], x)
    assert (gate > 7).any() and (gate.abs() < 7).any()
    kind = ExpertKind(activation="swiglu_oai")
    out = kernel(x, w13, w2, weights, ids, kind=kind, b13=b13, b2=b2)
    assert relative(out, swiglu_oai_oracle(x, w13, w2, b13, b2, weights, ids)) < 1e-5


@pytest.mark.parametrize("kernel", [grouped_experts, fused_experts])
def test_expert_parallel_ranks_add_up_to_the_whole(kernel):
    """Two ranks with four whole experts each: each sees the global ids shifted to its own,
    the other rank's as ids past its last; their sums are the whole layer's."""
    x, w13, w2, weights, ids = problem(29, 8, 2, 48, 40, torch.float32)
    parts = []
    for first in (0, 4):
        local = ids - first
        local = torch.where((local >= 0) & (local < 4), local, 4)
        parts.append(kernel(x, w13[first : first + 4], w2[first : first + 4], weights, local))
    assert relative(parts[0] + parts[1], oracle(x, w13, w2, weights, ids)) < 1e-5
    assert parts[0].abs().sum() > 0 and parts[1].abs().sum() > 0


@pytest.mark.parametrize("kernel", [grouped_experts, fused_experts])
def test_sliced_experts_add_up_to_the_whole(kernel):
    """Two ranks each holding half of every expert's intermediate rows."""
    x, w13, w2, weights, ids = problem(29, 8, 2, 48, 40, torch.float32)
    gate, up = w13[:, :40], w13[:, 40:]
    parts = [
        kernel(x, torch.cat([gate[:, s], up[:, s]], 1), w2[:, :, s], weights, ids)
        for s in (slice(0, 20), slice(20, 40))
    ]
    assert relative(parts[0] + parts[1], oracle(x, w13, w2, weights, ids)) < 1e-5


def test_sorted_layout_holds_every_pair_once_in_whole_expert_blocks():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [5, 6]])  # 6: held elsewhere (5 experts here)
    sorted_pairs, block_expert = align_by_expert(ids, 6, block_m=4)
    rows = sorted_pairs.view(-1, 4)
    placed = sorted(int(p) for p in sorted_pairs if p >= 0)
    assert placed == [0, 1, 2, 3, 4, 5, 6]  # pair 7 (id 6 of 6 experts) is dropped
    for block, expert in zip(rows, block_expert.tolist(), strict=True):
        pairs = [int(p) for p in block if p >= 0]
        if expert < 0:
            assert not pairs
        assert all(int(ids.view(-1)[p]) == expert for p in pairs)
    # Shapes follow from the pair and expert counts alone, not the routing.
    other = align_by_expert(torch.zeros_like(ids), 6, block_m=4)
    assert other[0].shape == sorted_pairs.shape and other[1].shape == block_expert.shape


def test_router_ties_go_where_transformers_sends_them():
    """Experts 1 and 3 (and 0 and 2) have the same router rows: every token's scores tie."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=8, num_local_experts=4, num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    rows = torch.randn(2, 8)
    router.weight.data = torch.stack([rows[0], rows[1], rows[0], rows[1]])
    x = torch.randn(10, 8)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight), 2, renormalize=True)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_deepseek_routers_choose_and_weigh_as_transformers_does():
    """V2's group-limited softmax and V3's biased sigmoid over expert groups, with a learned
    score bias that changes the choice but not the weights."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from kernels.moe.reference import biased_group_top_k, group_limited_top_k

    common = dict(hidden_size=16, num_attention_heads=4, n_routed_experts=16,
                  num_experts_per_tok=3, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5)  # fmt: skip
    x = torch.randn(33, 16)
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(**common, norm_topk_prob=True))
    v3.weight.data.normal_()
    v3.e_score_correction_bias.normal_(std=0.3)
    _, hf_weights, hf_ids = v3(x)
    logits = F.linear(x, v3.weight)
    weights, ids = biased_group_top_k(logits, v3.e_score_correction_bias, 3, 4, 2, renormalize=True)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights * 2.5, hf_weights)
    unbiased = biased_group_top_k(logits, torch.zeros(16), 3, 4, 2, renormalize=True)[1]
    assert not torch.equal(unbiased.sort().values, ids.sort().values)  # the bias mattered

    v2 = DeepseekV2TopkRouter(DeepseekV2Config(**common, topk_method="group_limited_greedy"))
    v2.weight.data.normal_()
    _, hf_weights, hf_ids = v2(x)
    weights, ids = group_limited_top_k(F.linear(x, v2.weight), 3, 4, 2)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights * 2.5, hf_weights)


def test_gpt_oss_router_softmaxes_its_top_logits_as_transformers_does():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from kernels.moe.reference import top_k_softmax

    router = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=8,
                                           num_experts_per_tok=3))  # fmt: skip
    router.weight.data.normal_()
    router.bias.data.normal_()
    x = torch.randn(21, 16)
    _, hf_weights, hf_ids = router(x)
    weights, ids = top_k_softmax(F.linear(x, router.weight, router.bias), 3)
    assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights)


def test_fused_experts_and_routers_never_read_the_device_back():
    """What a decode graph captures of a MoE layer: every router and the fused kernels with
    their sorting, ids held elsewhere included (expert parallelism), under the host-sync
    guard. The torch path (CPUs) reads expert counts back and is refused by the same guard."""
    from kernels.moe.reference import biased_group_top_k, group_limited_top_k
    from tests.host_sync_guard import HostSyncError, refuse_host_syncs

    x, w13, w2, _, _ = problem(13, 8, 2, 48, 40, torch.float32)
    logits = torch.randn(13, 8)
    with refuse_host_syncs():
        choices = [
            select_experts(logits, 2, renormalize=True),
            group_limited_top_k(logits, 2, 4, 2),
            biased_group_top_k(logits, torch.randn(8), 2, 4, 2, renormalize=True),
        ]
        held = [(w, torch.where(ids < 4, ids, 4)) for w, ids in choices]  # experts 4-7 elsewhere
        outputs = [fused_experts(x, w13[:4], w2[:4], w, ids) for w, ids in held]
    for (weights, ids), out in zip(held, outputs, strict=True):
        assert relative(out, oracle(x, w13[:4], w2[:4], weights, ids)) < 1e-5
    with pytest.raises(HostSyncError), refuse_host_syncs():
        grouped_experts(x, w13, w2, *choices[0])
