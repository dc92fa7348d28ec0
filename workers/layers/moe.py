"""A mixture-of-experts MLP under tensor parallelism: the router (replicated: every rank scores
every expert), the experts, and Qwen2-MoE's gated shared expert. By default each expert is
split across the TP group by its intermediate dimension (a rank holds the same slice of every
expert, as a dense MLP is split); with expert parallelism each rank holds whole experts. Every
rank sees every token (the hidden states are replicated over the TP group), so either way a
rank's experts give a partial sum of each token's output and one all-reduce completes it: no
token moves between ranks.

Checkpoints name experts one by one (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``,
Mixtral's ``w1`` / ``w3`` / ``w2``) or stacked (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); both load into the stacked parameters here, each rank reading
its own slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import run_experts, select_experts
from kernels.moe.reference import biased_group_top_k, group_limited_top_k
from workers.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from workers.model_config import ExpertShard, MoEConfig
from workers.parallel import all_reduce, get_tp_group


class Experts(nn.Module):
    """This rank's share of every expert's gate/up (``w13``: [E_rank, 2 I_rank, H]) and down
    (``w2``: [E_rank, H, I_rank]) projections: whole experts [first, first + E_rank) under
    expert parallelism, else an I_rank slice of all of them (``MoEConfig.placement``)."""

    def __init__(self, moe: MoEConfig, hidden_size: int, dtype):
        super().__init__()
        tp = get_tp_group()
        self.shard = shard = moe.placement(tp.world_size, tp.rank, tp.expert_parallel)
        self.num_experts, self.intermediate_size = moe.num_experts, moe.intermediate_size
        count, size = shard.num_experts, shard.intermediate_size
        self.w13 = _param((count, 2 * size, hidden_size), dtype, self.load_w13)
        self.w2 = _param((count, hidden_size, size), dtype, self.load_w2)
        # Loaded one expert at a time (shard (expert, part)), or all at once (no shard).
        every = range(moe.num_experts)
        self.w13.expected_shards = [(e, p) for e in every for p in ("gate", "up")]
        self.w2.expected_shards = [(e, "down") for e in every]

    def _local(self, expert: int) -> int | None:
        """The index here of checkpoint expert ``expert`` (None: another rank holds it)."""
        local = expert - self.shard.first_expert
        return local if 0 <= local < self.shard.num_experts else None

    def load_w13(self, param: nn.Parameter, loaded, shard=None) -> None:
        start, size, full = (
            self.shard.intermediate_start,
            self.shard.intermediate_size,
            self.intermediate_size,
        )
        if shard is None:  # every expert's, stacked: [E, 2I, H]
            _check(loaded, (self.num_experts, 2 * full, param.shape[2]))
            mine = loaded.narrow(0, self.shard.first_expert, self.shard.num_experts)
            param.data[:, :size].copy_(mine.narrow(1, start, size))
            param.data[:, size:].copy_(mine.narrow(1, full + start, size))
            return
        expert, part = shard
        _check(loaded, (full, param.shape[2]))
        local = self._local(expert)
        if local is not None:
            offset = 0 if part == "gate" else size
            param.data[local, offset : offset + size].copy_(loaded.narrow(0, start, size))

    def load_w2(self, param: nn.Parameter, loaded, shard=None) -> None:
        start, size = self.shard.intermediate_start, self.shard.intermediate_size
        if shard is None:  # [E, H, I]
            _check(loaded, (self.num_experts, param.shape[1], self.intermediate_size))
            mine = loaded.narrow(0, self.shard.first_expert, self.shard.num_experts)
            param.data.copy_(mine.narrow(2, start, size))
            return
        expert, _ = shard
        _check(loaded, (param.shape[1], self.intermediate_size))
        local = self._local(expert)
        if local is not None:
            param.data[local].copy_(loaded.narrow(1, start, size))

    def forward(self, hidden, topk_weights, topk_ids) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs: under expert parallelism
        its own experts' whole outputs (the tokens routed elsewhere skip them), else every
        expert's output through this rank's slice."""
        if self.shard.num_experts != self.num_experts:
            local = topk_ids - self.shard.first_expert
            mine = (local >= 0) & (local < self.shard.num_experts)
            topk_ids = torch.where(mine, local, self.shard.num_experts)  # past the last: skipped
        return run_experts(hidden, self.w13, self.w2, topk_weights, topk_ids)


def expert_placements(model: nn.Module) -> dict[str, ExpertShard]:
    """Module name -> what this rank holds of that MoE layer's experts."""
    return {name: m.shard for name, m in model.named_modules() if isinstance(m, Experts)}


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense SiLU MLP every token runs, its output scaled by
    ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype):
        super().__init__()
        width = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, width, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Scores every expert for each token (every rank, whole) and picks its ``top_k`` by the
    model's routing method; returns ([T, k] weights, [T, k] expert ids)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.moe = moe
        self.weight = _param((moe.num_experts, hidden_size), dtype, _copy)
        # DeepSeek-V3 chooses on scores plus this learned bias (float32, as published).
        self.e_score_correction_bias = None
        if moe.routing == "noaux_tc":
            self.e_score_correction_bias = _param((moe.num_experts,), torch.float32, _copy)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.routing == "greedy" and moe.routed_scaling_factor == 1.0:
            return select_experts(
                F.linear(x, self.weight), moe.top_k, renormalize=moe.norm_topk_prob
            )
        logits = F.linear(x.float(), self.weight.float())  # DeepSeek routes in float32
        if moe.routing == "noaux_tc":
            weights, ids = biased_group_top_k(
                logits, self.e_score_correction_bias, moe.top_k, moe.n_group, moe.topk_group,
                renormalize=moe.norm_topk_prob,
            )  # fmt: skip
        elif moe.routing == "group_limited_greedy":
            weights, ids = group_limited_top_k(logits, moe.top_k, moe.n_group, moe.topk_group)
        else:
            weights, ids = torch.topk(logits.softmax(dim=-1), moe.top_k, dim=-1, sorted=False)
        return weights * moe.routed_scaling_factor, ids


class SparseMoE(nn.Module):
    """Router, experts and shared experts of one MoE layer; the attribute names are the
    checkpoints' (Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``, DeepSeek's
    ``shared_experts``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.gate = Router(hidden_size, moe, dtype)
        self.experts = Experts(moe, hidden_size, dtype)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if shared and moe.shared_expert_gated:
            self.shared_expert = SharedExpert(hidden_size, shared, dtype)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, dtype=dtype)
        elif shared:
            self.shared_experts = SharedExpert(hidden_size, shared, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _copy(param: nn.Parameter, loaded) -> None:
    _check(loaded, tuple(param.shape))
    param.data.copy_(loaded.narrow(0, 0, param.shape[0]))


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def _check(loaded, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
