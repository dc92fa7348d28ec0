"""A mixture-of-experts MLP under tensor parallelism: the router (replicated: every rank scores
every expert), the experts, and the shared experts. By default each expert is split across the
TP group by its intermediate dimension (a rank holds the same slice of every expert, as a dense
MLP is split); with expert parallelism each rank holds whole experts. Every rank sees every
token (the hidden states are replicated over the TP group), so either way a rank's experts
give a partial sum of each token's output and one all-reduce completes it: no token moves
between ranks.

Checkpoints name experts one by one (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``,
Mixtral's ``w1`` / ``w3`` / ``w2``) or stacked (``experts.gate_up_proj`` [E, 2I, H], or
``experts.up_proj`` [E, I, H] for ungated experts, and ``experts.down_proj`` [E, H, I]); both
load into the stacked parameters here, each rank reading its own slice
(``expert_checkpoint_target`` says where a tensor goes)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import ExpertKind, run_experts, select_experts
from kernels.moe.reference import biased_group_top_k, group_limited_top_k, top_k_softmax
from workers.layers.cpu_matmul import linear, pack_weight
from workers.layers.linear import ReplicatedLinear
from workers.layers.mlp import MLP
from workers.model_config import ExpertShard, MoEConfig
from workers.parallel import all_reduce, get_tp_group

# Per-expert and stacked checkpoint tensors: (layer prefix, MoE module, expert, projection).
EXPERT_TENSOR = re.compile(
    r"^(.*)\.(mlp|block_sparse_moe|mixer)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
STACKED_TENSOR = re.compile(
    r"^(.*)\.(mlp|mixer)\.experts\.(gate_up_proj|up_proj|down_proj)(_bias)?$"
)
PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}  # fmt: skip


def expert_checkpoint_target(name: str, module: str) -> tuple[str, object] | None:
    """Our stacked parameter, and the part of it, for an expert tensor of the checkpoint (None:
    not an expert tensor). ``module`` is our MoE module's name in each layer (``mlp``,
    NemotronH's ``mixer``)."""
    if match := EXPERT_TENSOR.match(name):
        prefix, _, expert, projection = match.groups()
        part = PARTS[projection]
        weight = "w2" if part == "down" else "w13"
        return f"{prefix}.{module}.experts.{weight}", (int(expert), part)
    if match := STACKED_TENSOR.match(name):
        prefix, _, projection, bias = match.groups()
        weight = ("b" if bias else "w") + ("2" if projection == "down_proj" else "13")
        return f"{prefix}.{module}.experts.{weight}", None  # every expert at once
    return None


class Experts(nn.Module):
    """This rank's share of every expert's gate and up (``w13``: [E_rank, 2 I_rank, H]; up
    alone, [E_rank, I_rank, H], for ungated experts) and down (``w2``: [E_rank, H, I_rank])
    projections: whole experts [first, first + E_rank) under expert parallelism, else an I_rank
    slice of all of them (``MoEConfig.placement``)."""

    def __init__(self, moe: MoEConfig, input_size: int, dtype):
        super().__init__()
        tp = get_tp_group()
        self.shard = shard = moe.placement(tp.world_size, tp.rank, tp.expert_parallel)
        self.num_experts, self.intermediate_size = moe.num_experts, moe.intermediate_size
        self.kind = ExpertKind(moe.gated, moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
        self.stacked_layout = moe.stacked_layout
        self.parts = ("gate", "up") if moe.gated else ("up",)
        count, size = shard.num_experts, shard.intermediate_size
        self.w13 = _param((count, len(self.parts) * size, input_size), dtype, self.load_w13)
        self.w2 = _param((count, input_size, size), dtype, self.load_w2)
        # Loaded one expert at a time (shard (expert, part)), or all at once (no shard).
        every = range(moe.num_experts)
        self.w13.expected_shards = [(e, p) for e in every for p in self.parts]
        self.w2.expected_shards = [(e, "down") for e in every]
        # gpt-oss's biases, stacked in its checkpoints. The down bias is added once: by the
        # rank holding the expert (expert parallelism), else by rank 0 alone.
        self.b13 = self.b2 = None
        if moe.expert_bias:
            self.b13 = _param((count, len(self.parts) * size), dtype, self.load_b13)
            self.b2 = _param((count, input_size), dtype, self.load_b2)
        self.adds_down_bias = tp.expert_parallel or tp.rank == 0
        self._project = None  # oneDNN-packed products on CPUs (pack_for_cpu)

    def _local(self, expert: int) -> int | None:
        """The index here of checkpoint expert ``expert`` (None: another rank holds it)."""
        local = expert - self.shard.first_expert
        return local if 0 <= local < self.shard.num_experts else None

    def load_w13(self, param: nn.Parameter, loaded, shard=None) -> None:
        start, size = self.shard.intermediate_start, self.shard.intermediate_size
        full = self.intermediate_size
        if shard is None and self.stacked_layout == "gpt_oss":  # [E, H, 2I], interleaved
            _check(loaded, (self.num_experts, param.shape[2], 2 * full))
            mine = loaded.narrow(0, self.shard.first_expert, self.shard.num_experts)
            for index in range(2):  # gate columns are the even ones, up the odd ones
                columns = mine[..., index::2][..., start : start + size]
                param.data[:, index * size : (index + 1) * size].copy_(columns.transpose(1, 2))
            return
        if shard is None:  # every expert's, stacked: [E, parts x I, H]
            _check(loaded, (self.num_experts, len(self.parts) * full, param.shape[2]))
            mine = loaded.narrow(0, self.shard.first_expert, self.shard.num_experts)
            for index in range(len(self.parts)):
                rows = mine.narrow(1, index * full + start, size)
                param.data[:, index * size : (index + 1) * size].copy_(rows)
            return
        expert, part = shard
        _check(loaded, (full, param.shape[2]))
        local = self._local(expert)
        if local is not None:
            offset = self.parts.index(part) * size
            param.data[local, offset : offset + size].copy_(loaded.narrow(0, start, size))

    def load_w2(self, param: nn.Parameter, loaded, shard=None) -> None:
        start, size = self.shard.intermediate_start, self.shard.intermediate_size
        if shard is None and self.stacked_layout == "gpt_oss":  # [E, I, H]
            _check(loaded, (self.num_experts, self.intermediate_size, param.shape[1]))
            mine = loaded.narrow(0, self.shard.first_expert, self.shard.num_experts)
            param.data.copy_(mine.narrow(1, start, size).transpose(1, 2))
            return
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

    def load_b13(self, param: nn.Parameter, loaded) -> None:
        """gpt-oss's [E, 2I] gate/up bias, its columns interleaved as the weight's."""
        start, size = self.shard.intermediate_start, self.shard.intermediate_size
        _check(loaded, (self.num_experts, 2 * self.intermediate_size))
        mine = loaded.narrow(0, self.shard.first_expert, self.shard.num_experts)
        for index in range(2):
            param.data[:, index * size : (index + 1) * size].copy_(
                mine[:, index::2][:, start : start + size]
            )

    def load_b2(self, param: nn.Parameter, loaded) -> None:
        _check(loaded, (self.num_experts, param.shape[1]))
        param.data.copy_(loaded.narrow(0, self.shard.first_expert, self.shard.num_experts))

    def forward(self, hidden, topk_weights, topk_ids) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs: under expert parallelism
        its own experts' whole outputs (the tokens routed elsewhere skip them), else every
        expert's output through this rank's slice."""
        if self.shard.num_experts != self.num_experts:
            local = topk_ids - self.shard.first_expert
            mine = (local >= 0) & (local < self.shard.num_experts)
            topk_ids = torch.where(mine, local, self.shard.num_experts)  # past the last: skipped
        return run_experts(
            hidden, self.w13, self.w2, topk_weights, topk_ids, kind=self.kind, b13=self.b13,
            b2=self.b2 if self.adds_down_bias else None, project=self._project,
        )  # fmt: skip

    def pack_for_cpu(self) -> bool:
        """Each expert's two projections packed for oneDNN, as the dense layers' are
        (``workers.layers.cpu_matmul``): a few rows per expert is where packing pays most.
        The unpacked stacks are let go; they keep their expert count for the kernels."""
        packed = {
            which: [pack_weight(weight[e]) for e in range(weight.shape[0])]
            for which, weight in (("w13", self.w13), ("w2", self.w2))
        }
        if any(p is None for weights in packed.values() for p in weights):
            return False
        self._packed = packed
        self._project = self._packed_product
        for weight in (self.w13, self.w2):
            weight.data = torch.empty((weight.shape[0], 0, 0), dtype=weight.dtype)
        return True

    def _packed_product(self, rows: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        return linear(rows, None, self._packed[which][expert])


def expert_placements(model: nn.Module) -> dict[str, ExpertShard]:
    """Module name -> what this rank holds of that MoE layer's experts."""
    return {name: m.shard for name, m in model.named_modules() if isinstance(m, Experts)}


class Router(nn.Module):
    """Scores every expert for each token (every rank, whole) and picks its ``top_k`` by the
    model's routing method; returns ([T, k] weights, [T, k] expert ids)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.moe = moe
        self.weight = _whole((moe.num_experts, hidden_size), dtype)
        self.bias = _whole((moe.num_experts,), dtype) if moe.router_bias else None
        # DeepSeek-V3 and NemotronH choose on scores plus this learned bias (float32).
        self.e_score_correction_bias = None
        if moe.routing == "noaux_tc":
            self.e_score_correction_bias = _whole((moe.num_experts,), torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        weight, bias = self.weight, self.bias
        if moe.router_in_float32:
            x, weight = x.float(), weight.float()
            bias = None if bias is None else bias.float()
        logits = F.linear(x, weight, bias)
        if moe.routing == "topk_softmax":
            weights, ids = top_k_softmax(logits, moe.top_k)
        elif moe.routing == "noaux_tc":
            weights, ids = biased_group_top_k(
                logits, self.e_score_correction_bias, moe.top_k, moe.n_group, moe.topk_group,
                renormalize=moe.norm_topk_prob,
            )  # fmt: skip
        elif moe.routing == "group_limited_greedy":
            weights, ids = group_limited_top_k(logits, moe.top_k, moe.n_group, moe.topk_group)
        else:
            weights, ids = select_experts(logits, moe.top_k, renormalize=moe.norm_topk_prob)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids


class SparseMoE(nn.Module):
    """Router, experts and shared experts of one MoE layer; the attribute names are the
    checkpoints' (Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``, DeepSeek's and
    NemotronH's ``shared_experts``, NemotronH's latent projections ``fc1_latent_proj`` and
    ``fc2_latent_proj``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype):
        super().__init__()
        self.gate = Router(hidden_size, moe, dtype)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if moe.latent_size:
            bias, latent = moe.mlp_bias, moe.latent_size
            self.fc1_latent_proj = ReplicatedLinear(hidden_size, latent, bias=bias, dtype=dtype)
            self.fc2_latent_proj = ReplicatedLinear(latent, hidden_size, bias=bias, dtype=dtype)
        self.experts = Experts(moe, moe.latent_size or hidden_size, dtype)
        # Shared experts: a dense MLP of the experts' kind every token runs beside them.
        shared = moe.shared_expert_intermediate_size and MLP(
            hidden_size, moe.shared_expert_intermediate_size, gated=moe.gated,
            activation=moe.activation, bias=moe.mlp_bias, dtype=dtype,
        )  # fmt: skip
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if shared and moe.shared_expert_gated:  # Qwen2-MoE's, scaled by a sigmoid gate
            self.shared_expert = shared
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False, dtype=dtype)
        elif shared:  # DeepSeek's and NemotronH's
            self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed_in = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = all_reduce(self.experts(routed_in, weights, ids))
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _whole(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A parameter every rank holds whole (the loader copies it, checking its shape)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def _check(loaded, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
